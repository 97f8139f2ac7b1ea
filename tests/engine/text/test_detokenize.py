"""TextStream with the real SmolLM2 tokenizer: multi-byte characters, word boundaries and stop
strings, token by token."""

from __future__ import annotations

import pytest

from engine.text.detokenize import TextStream, _is_cjk

TEXTS = [
    "Hello 👋🏽 world! Café crème brûlée, naïve façade.",
    "日本語のテキスト と 中文 와 한국어 mixed in.",
    "مرحبا بالعالم and שלום עולם read right to left.",
    "Flags 🇫🇷🏳️‍🌈 and families 👨‍👩‍👧 are many code points.",
    "  double  spaces\n\nnew\tlines and a trailing space ",
    "∑∫√ “quotes” — dashes… ends with an emoji 🙂",
]


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stream_all(tokenizer, ids, stop_strings=(), context=()) -> tuple[list[str], TextStream]:
    stream = TextStream(tokenizer, context, stop_strings)
    pieces = [stream.push(token_id) for token_id in ids]
    pieces.append(stream.finish())
    return pieces, stream


@pytest.fixture
def context(tokenizer) -> list[int]:
    """A chat prompt the reply follows, as the session passes it."""
    return ids_of(tokenizer, "<|im_start|>assistant\n")


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_join_to_the_full_decode(tokenizer, context, text):
    ids = ids_of(tokenizer, text)
    assert len(ids) > 5
    pieces, stream = stream_all(tokenizer, ids, context=context)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == expected
    assert stream.text == expected and not stream.stopped


@pytest.mark.parametrize("text", TEXTS)
def test_no_piece_holds_half_a_character(tokenizer, text):
    ids = ids_of(tokenizer, text)
    # Some of these characters span several tokens: the test must cover that case.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or text.isascii()
    pieces, _ = stream_all(tokenizer, ids)
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_end_at_whitespace(tokenizer, text):
    ids = ids_of(tokenizer, text)
    pieces, _ = stream_all(tokenizer, ids)
    released = [piece for piece in pieces[:-1] if piece]  # all but finish()'s
    assert released, "a long text must stream before it is finished"
    for piece in released:
        assert piece[-1].isspace() or _is_cjk(piece[-1]), f"broken word piece {piece!r}"


def test_special_tokens_are_not_released(tokenizer):
    ids = [*ids_of(tokenizer, "Done here."), tokenizer.eos_token_id]
    pieces, _ = stream_all(tokenizer, ids)
    assert "".join(pieces) == "Done here."


def test_last_push_flushes_everything(tokenizer):
    text = "The last word is kept until the end: 日本"
    ids = ids_of(tokenizer, text)
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids[:-1]]
    assert "".join(pieces) != text  # the tail is still held back
    pieces.append(stream.push(ids[-1], last=True))
    assert "".join(pieces) == text
    assert stream.finish() == ""


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The answer is 42.\nUser: what else?", "User:", "The answer is 42.\n"),
        ("First paragraph.\n\nSecond paragraph.", "\n\n", "First paragraph."),
        ("alphabetagamma delta", "betagam", "alpha"),  # inside one word, across tokens
        ("Café crème 日本語のテキスト end", "本語の", "Café crème 日"),  # inside multi-byte
        ("Say STOP now", "STOP", "Say "),
    ],
)
def test_stop_string_cuts_the_text_before_it(tokenizer, text, stop, expected):
    ids = ids_of(tokenizer, text)
    assert not any(stop in tokenizer.decode([i]) for i in ids)  # split across tokens
    pieces, stream = stream_all(tokenizer, ids, stop_strings=(stop,))
    assert stream.stopped
    assert "".join(pieces) == expected == stream.text
    assert not any(stop in piece for piece in pieces)
    for released in range(1, len(pieces) + 1):  # never even partly shown
        assert stop not in "".join(pieces[:released])


def test_stream_ignores_tokens_after_a_stop(tokenizer):
    ids = ids_of(tokenizer, "one two END three four")
    stream = TextStream(tokenizer, (), ("END",))
    shown = "".join(stream.push(i) for i in ids)
    assert stream.stopped
    assert shown + stream.finish() == "one two "
    assert stream.push(ids[0]) == "" and stream.push(ids[0], last=True) == ""


def test_earliest_of_several_stop_strings_wins(tokenizer):
    ids = ids_of(tokenizer, "two stops: END and then STOP")
    pieces, stream = stream_all(tokenizer, ids, stop_strings=("STOP", "END"))
    assert stream.stopped and "".join(pieces) == "two stops: "


def test_stop_string_absent_streams_whole_words(tokenizer):
    """Holding back a long stop string's length of text must not split the words before it."""
    text = "No stop string appears in this sentence at all, so it all streams out."
    ids = ids_of(tokenizer, text)
    pieces, stream = stream_all(tokenizer, ids, stop_strings=("### Instruction:", ""))
    assert not stream.stopped and "".join(pieces) == text
    released = [p for p in pieces[:-1] if p]
    assert len(released) >= 3
    for piece in released:
        assert piece[-1] in " \n\t", f"broken word piece {piece!r}"


def test_text_that_only_looks_like_a_stop_prefix_is_released(tokenizer):
    text = "User said Use the tool"
    pieces, stream = stream_all(tokenizer, ids_of(tokenizer, text), stop_strings=("User:",))
    assert not stream.stopped and "".join(pieces) == text


def test_cjk_text_streams_character_by_character(tokenizer):
    # No spaces between words: waiting for whitespace would hold the whole line back.
    text = "東京は日本の首都です"
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]
    released = "".join(pieces)
    assert len(released) >= len(text) - 2  # at most a character or two still pending
    assert released + stream.finish() == text


def test_a_long_run_without_spaces_is_not_held_back_forever(tokenizer):
    text = "(K-V-C-A-L-A-R-A-L-A-R-A-L-A-R-A-L-A-R-A-L-A-R-A-L-A-R-A-L-A-R) done"
    stream = TextStream(tokenizer)
    pieces = [stream.push(i) for i in ids_of(tokenizer, text)]
    assert len("".join(pieces)) > 32  # released before any whitespace arrived
    assert "".join(pieces) + stream.finish() == text
