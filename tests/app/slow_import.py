"""Imported by a test's engine process at start: as slow as importing torch can be."""

import time

time.sleep(30)
