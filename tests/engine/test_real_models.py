"""Checks on the real Q4_K_M models `make models` fetches (skipped where they are absent)."""

from __future__ import annotations

import pytest

from engine import chat_format
from engine.loader import default_cache_dir, gguf_tokenizer
from engine.prompt import encode_chat
from engine.settings import Message

QUESTION = [Message("user", "What is the capital of France?")]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_the_gemma_file_without_a_template_gets_gemmas_turns(real_gemma, lean):
    tokenizer = gguf_tokenizer(real_gemma, default_cache_dir(), lambda *_: None, lean=lean)
    assert not tokenizer.chat_template  # the file has none
    assert chat_format.apply(tokenizer, "gemma3") == "gemma"
    ids = encode_chat(tokenizer, QUESTION)
    # <bos> <start_of_turn> user \n ... <end_of_turn> \n <start_of_turn> model \n
    assert ids[:4] == [2, 105, 2364, 107] and ids[-5:] == [106, 107, 105, 4368, 107]
    assert chat_format.end_of_turn_ids(tokenizer) == {106}


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_the_qwen_file_keeps_its_own_template_and_stops_at_im_end(real_qwen, lean):
    tokenizer = gguf_tokenizer(real_qwen, default_cache_dir(), lambda *_: None, lean=lean)
    assert chat_format.apply(tokenizer, "qwen2") == chat_format.OWN
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in chat_format.end_of_turn_ids(tokenizer)
    assert (
        encode_chat(tokenizer, QUESTION)[-3:]
        == tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    )
