"""Glassbox's inference core: load a causal LM, prefill, decode, and observe it.

Pure Python, torch and transformers; never imports Qt (an import-linter contract enforces it).
"""
