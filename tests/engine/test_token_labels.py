"""Token chips: the bytes of tokens that are not whole characters, the template's special
tokens, and the weight bytes a pass reads, as the engine reports them."""

from __future__ import annotations

import pytest

from engine.events import PrefillDone
from engine.generate.session import ChatSession
from engine.settings import GenerationSettings, Message, ProbeSettings
from engine.token_labels import byte_count, byte_label, label, special_ids
from tests.models import make_tiny


def test_a_character_split_across_tokens_is_labelled_with_its_bytes(tokenizer):
    text = " 日本’"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    labels = [label(tokenizer, i, tokenizer.decode([i])) for i in ids]
    assert any(labels), "the test text should split a character"
    # Each label is its token's text or its bytes; read back in order, they are the text.
    data = b"".join(
        bytes(int(part[2:], 16) for part in lab.strip("<>").split("><"))
        if lab
        else tokenizer.decode([i]).encode()
        for i, lab in zip(ids, labels, strict=True)
    )
    assert data.decode() == text
    assert all(lab.startswith("<0x") for lab in labels if lab)


def test_whole_characters_need_no_label(tokenizer):
    for i in tokenizer(" hello world", add_special_tokens=False)["input_ids"]:
        assert label(tokenizer, i, tokenizer.decode([i])) == ""


def test_byte_label():
    assert byte_label("’".encode()) == "<0xE2><0x80><0x99>"


def test_the_chat_templates_markers_are_special(tokenizer):
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert start in special_ids(tokenizer)
    assert tokenizer("hello", add_special_tokens=False)["input_ids"][0] not in special_ids(
        tokenizer
    )


@pytest.fixture(scope="module")
def events(tokenizer) -> list:
    session = ChatSession(make_tiny(tokenizer, "llama"))
    settings = GenerationSettings(max_new_tokens=4, greedy=True)
    messages = [Message("user", "Say ’日本’")]
    return list(session.generate(messages, settings, ProbeSettings.off()))


def test_the_prefill_labels_every_prompt_token_and_marks_the_special_ones(events, tokenizer):
    prefill = next(e for e in events if isinstance(e, PrefillDone))
    assert len(prefill.prompt_labels) == prefill.prompt_tokens
    marker = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert marker in prefill.special_ids
    assert set(prefill.special_ids) <= set(prefill.prompt_token_ids)
    assert any(lab.startswith("<0x") for lab in prefill.prompt_labels)


def test_the_model_says_what_a_pass_reads_of_its_weights(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"))
    cost = session.meter.cost
    assert session.info.weight_bytes == cost.weight_bytes > 0
    assert session.info.embedding_row_bytes == cost.row_bytes > 0


def test_a_byte_label_counts_its_bytes_and_text_counts_none():
    assert byte_count("<0xE2>") == 1
    assert byte_count("<0xE2><0x80>") == 2
    assert byte_count(" the") == 0
    assert byte_count("<0xE2> x") == 0  # not only bytes: text


def test_a_right_to_left_token_is_isolated_inside_its_quotes():
    """Hebrew or Arabic letters are isolated (U+2068 ... U+2069): beside them a closing quote
    and a probability were drawn inside the token's run ("'31 'مرحبا%"). Any other token is
    shown as repr shows it, nothing added."""
    from engine.token_labels import quoted

    assert quoted(" the") == "' the'" and quoted("it's") == '"it\'s"'
    assert quoted("<0xE2>") == "'<0xE2>'"
    assert quoted("مرحبا") == "'\u2068مرحبا\u2069'"
    assert quoted(" שלום\n") == "'\u2068 שלום\\n\u2069'"
