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


# -- per token (what the API streams) --------------------------------------------------------


def stream_per_token(tokenizer, ids, stop_strings=(), context=()) -> tuple[list[str], TextStream]:
    stream = TextStream(tokenizer, context, stop_strings, per_token=True)
    pieces = [stream.push(token_id) for token_id in ids]
    pieces.append(stream.finish())
    return pieces, stream


def whole_characters(text: str) -> str:
    """A partial decode without its unfinished character (decoded as U+FFFD)."""
    return text.rstrip("\ufffd")


@pytest.mark.parametrize("text", TEXTS)
def test_per_token_pieces_join_to_the_full_decode(tokenizer, context, text):
    ids = ids_of(tokenizer, text)
    pieces, stream = stream_per_token(tokenizer, ids, context=context)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == expected == stream.text and not stream.stopped


@pytest.mark.parametrize("text", TEXTS)
def test_per_token_releases_every_whole_character_with_its_token(tokenizer, text):
    ids = ids_of(tokenizer, text)
    pieces, _ = stream_per_token(tokenizer, ids)
    assert pieces[-1] == ""  # nothing was left for the end
    for count in range(1, len(ids) + 1):
        shown, decoded = "".join(pieces[:count]), tokenizer.decode(ids[:count])
        assert "\ufffd" not in shown
        if decoded.endswith("\ufffd"):  # a character still unfinished: that token waits
            assert whole_characters(decoded).startswith(shown), f"after {count} tokens"
        else:  # every character so far is out, with the token that finished it
            assert shown == decoded, f"after {count} tokens"


def test_a_token_that_ends_a_word_is_released_with_it(tokenizer):
    ids = ids_of(tokenizer, "Hello world")
    assert len(ids) == 2  # "Hello", " world": no whitespace follows the first word yet
    stream = TextStream(tokenizer, (), (), per_token=True)
    assert stream.push(ids[0]) == "Hello"
    assert stream.push(ids[1]) == " world"
    words = TextStream(tokenizer)  # by whole words, the first waits for the next token
    assert words.push(ids[0]) == ""


def test_a_character_split_over_two_tokens_is_released_whole(tokenizer):
    ids = ids_of(tokenizer, "Hi 👋")
    split = next(i for i in range(len(ids)) if tokenizer.decode(ids[: i + 1]).endswith("\ufffd"))
    stream = TextStream(tokenizer, (), (), per_token=True)
    pieces = [stream.push(token_id) for token_id in ids]
    assert pieces[split] == ""  # its first bytes alone are no character: held
    assert "".join(pieces) == "Hi 👋" and pieces[-1].endswith("👋")


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("The answer is 42.\nUser: what else?", "User:", "The answer is 42.\n"),
        ("First paragraph.\n\nSecond paragraph.", "\n\n", "First paragraph."),
        ("alphabetagamma delta", "betagam", "alpha"),
        ("Café crème 日本語のテキスト end", "本語の", "Café crème 日"),
        ("Say STOP now", "STOP", "Say "),
    ],
)
def test_per_token_never_leaks_a_stop_string_split_over_tokens(tokenizer, text, stop, expected):
    ids = ids_of(tokenizer, text)
    assert not any(stop in tokenizer.decode([i]) for i in ids)  # split across tokens
    pieces, stream = stream_per_token(tokenizer, ids, stop_strings=(stop,))
    assert stream.stopped and "".join(pieces) == expected == stream.text
    for released in range(1, len(pieces) + 1):  # not even its first characters
        shown = "".join(pieces[:released])
        assert expected.startswith(shown), shown


def test_per_token_holds_back_only_what_could_begin_a_stop_string(tokenizer):
    def shown(text: str) -> tuple[str, TextStream]:
        stream = TextStream(tokenizer, (), ("User:",), per_token=True)
        return "".join(stream.push(i) for i in ids_of(tokenizer, text)), stream

    held, stream = shown("Total: 12 User")
    assert held == "Total: 12 "  # "User" may still become "User:"; the rest is out at once
    assert held + stream.finish() == "Total: 12 User" and not stream.stopped
    assert shown("Total: 12 Users")[0] == "Total: 12 Users"  # "Users" never will
