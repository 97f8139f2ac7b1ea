"""Chat templates for GGUFs without one, and replies that stop at the end of their turn.

The tokenizers here are tiny word-level ones built in memory with just the special tokens a
case needs: no model file is read.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from engine.events import Peaks
from engine.generate.session import ChatSession
from engine.load.loader import LoadedModel, ModelLoadError, model_architecture, with_chat_format
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings, SettingsError
from engine.text import chat_format
from engine.text.prompt import encode_chat
from engine.text.tokenizer import LeanTokenizer
from tests.models import make_tiny

FIXED = Peaks(1e11, 1e10, "float32", "cpu", "fixed for the test")
WORDS = ["[UNK]", "user", "model", "assistant", "system", "hi", "hello", "Be", "brief.", "\n"]
WORDS += [":", "there"]
GEMMA_TOKENS = ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")
CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA3_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
CONFIG = {
    GEMMA_TOKENS: {"bos_token": "<bos>", "eos_token": "<eos>"},
    CHATML_TOKENS: {"eos_token": "<|endoftext|>"},
    LLAMA3_TOKENS: {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
}
CONVERSATION = [
    Message("system", "Be brief."),
    Message("user", "hi"),
    Message("assistant", "hello"),
    Message("user", "hi there"),
]


def backend(specials: tuple[str, ...]) -> Tokenizer:
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Fuse()  # pieces joined as they are: "\n" + "user" + ":"
    tokenizer.add_special_tokens(list(specials))
    return tokenizer


def lean(specials: tuple[str, ...], template: str | None = None) -> LeanTokenizer:
    return LeanTokenizer(backend(specials), dict(CONFIG.get(specials, {})), template)


def transformers_tokenizer(specials: tuple[str, ...], template: str | None = None):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend(specials), unk_token="[UNK]", **CONFIG.get(specials, {})
    )
    tokenizer.chat_template = template
    return tokenizer


BOTH = pytest.mark.parametrize("make", [lean, transformers_tokenizer], ids=["lean", "transformers"])


def rendered(tokenizer, messages=CONVERSATION) -> str:
    dicts = [m.as_dict() for m in messages]
    return tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False)


@BOTH
def test_a_gemma_without_a_template_gets_gemmas_turns(make):
    tokenizer = make(GEMMA_TOKENS)
    assert chat_format.apply(tokenizer, "gemma3") == "gemma"
    assert rendered(tokenizer) == (  # the system prompt folded into the first user turn
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n"
        "<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nhi there<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    assert rendered(tokenizer, CONVERSATION[1:2]) == (
        "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
    )


@BOTH
def test_chatml_and_llama3_by_architecture(make):
    qwen = make(CHATML_TOKENS)
    assert chat_format.apply(qwen, "qwen2") == "chatml"
    assert rendered(qwen, CONVERSATION[:2]) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    llama = make(LLAMA3_TOKENS)
    assert chat_format.apply(llama, "llama") == "llama3"
    assert rendered(llama, CONVERSATION[1:2]) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@BOTH
@pytest.mark.parametrize(
    ("architecture", "specials"),
    [
        ("gemma3", CHATML_TOKENS),  # Gemma's architecture, but no Gemma turn tokens
        ("qwen2", GEMMA_TOKENS),
        ("llama", ("<bos>", "<eos>")),  # neither Llama 3 headers nor ChatML
        ("gpt2", CHATML_TOKENS),  # no template known for the architecture
    ],
)
def test_without_the_templates_tokens_the_plain_transcript_stays(make, architecture, specials):
    tokenizer = make(specials)
    assert chat_format.apply(tokenizer, architecture) == chat_format.PLAIN
    assert not tokenizer.chat_template


@BOTH
def test_a_llama_with_chatml_tokens_gets_chatml(make):
    assert chat_format.apply(make(CHATML_TOKENS), "llama") == "chatml"


@BOTH
def test_the_models_own_template_is_kept(make):
    own = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = make(GEMMA_TOKENS, own)
    assert chat_format.apply(tokenizer, "gemma3") == chat_format.OWN
    assert tokenizer.chat_template == own


@BOTH
def test_a_choice_overrides_the_models_template_and_the_architecture(make):
    own = make(GEMMA_TOKENS, chat_format.CHATML)
    assert chat_format.apply(own, "gemma3", "plain") == chat_format.PLAIN
    assert not own.chat_template  # a base model's transcript, whatever the file carries
    other = make(GEMMA_TOKENS)
    assert chat_format.apply(other, "gpt2", "gemma") == "gemma"  # not guessed, but asked for
    assert other.chat_template == chat_format.GEMMA
    with pytest.raises(ValueError, match=r"llama3 chat template needs <\|start_header_id\|>"):
        chat_format.apply(make(GEMMA_TOKENS), "gemma3", "llama3")


def test_the_choice_is_a_load_request_checked_at_load(tokenizer):
    assert LoadRequest().chat_template == "auto"
    with pytest.raises(SettingsError, match="chat template must be one of auto, plain"):
        LoadRequest(chat_template="alpaca")
    tiny = make_tiny(tokenizer, "gemma3")
    own = replace(tiny, tokenizer=transformers_tokenizer(GEMMA_TOKENS, chat_format.CHATML))
    assert with_chat_format(own, guess=False, choice="plain").info.chat_format == "plain"
    wrong = replace(tiny, tokenizer=transformers_tokenizer(GEMMA_TOKENS))
    with pytest.raises(ModelLoadError, match="tiny-gemma3: the chatml chat template needs"):
        with_chat_format(wrong, guess=True, choice="chatml")
    assert chat_format.label("gemma", forced=True) == "the gemma chat template (--chat-template)"


def test_lean_and_transformers_tokenizers_encode_the_chosen_template_alike():
    lean_tokenizer, fast = lean(GEMMA_TOKENS), transformers_tokenizer(GEMMA_TOKENS)
    for tokenizer in (lean_tokenizer, fast):
        chat_format.apply(tokenizer, "gemma3")
    ids = encode_chat(lean_tokenizer, CONVERSATION)
    assert ids == encode_chat(fast, CONVERSATION)
    assert lean_tokenizer.backend.token_to_id("<start_of_turn>") in ids


@BOTH
def test_the_end_of_turn_token_is_the_templates_and_in_the_vocabulary(make):
    gemma = make(GEMMA_TOKENS)
    assert chat_format.end_of_turn_ids(gemma) == frozenset()  # no template yet
    chat_format.apply(gemma, "gemma3")
    assert chat_format.end_of_turn_ids(gemma) == {gemma.convert_tokens_to_ids("<end_of_turn>")}
    # A template that names <|im_end|> in a vocabulary without it: nothing to stop at.
    stray = make(GEMMA_TOKENS, chat_format.CHATML)
    assert chat_format.end_of_turn_ids(stray) == frozenset()


def test_loading_records_the_template_for_transformers_and_the_fast_path(tokenizer):
    tiny = make_tiny(tokenizer, "gemma3")
    assert model_architecture(tiny.model) == "gemma3_text"
    loaded = with_chat_format(replace(tiny, tokenizer=transformers_tokenizer(GEMMA_TOKENS)), True)
    assert loaded.info.chat_format == "gemma"
    assert "<start_of_turn>" in loaded.tokenizer.chat_template
    # Glassbox's own GGUF model names its architecture in its shape.
    fast_model = SimpleNamespace(shape=SimpleNamespace(architecture="qwen2"))
    fast = LoadedModel(fast_model, lean(CHATML_TOKENS), tiny.info)  # type: ignore[arg-type]
    assert with_chat_format(fast, guess=True).info.chat_format == "chatml"
    # Not a GGUF (a hub id or a folder): its own template or none, nothing guessed.
    folder = replace(tiny, tokenizer=transformers_tokenizer(GEMMA_TOKENS))
    assert with_chat_format(folder, guess=False).info.chat_format == chat_format.PLAIN
    assert chat_format.label("gemma").startswith("Gemma's chat template")


def scripted(session: ChatSession, pieces: list[str]) -> None:
    """Make the session's model pick `pieces` in turn (as tokens of the session's tokenizer)."""
    tokenizer = session.tokenizer
    ids = iter([tokenizer.convert_tokens_to_ids(p) for p in pieces])
    vocab = session.info.vocab_size

    def forward(ids_: torch.Tensor, cache, probe) -> torch.Tensor:
        logits = torch.zeros(vocab)
        logits[next(ids)] = 100.0
        return logits

    session.decoder.forward = forward  # type: ignore[method-assign]


def session_with(tokenizer, specials_tokenizer) -> ChatSession:
    return ChatSession(replace(make_tiny(tokenizer, "llama"), tokenizer=specials_tokenizer), FIXED)


@BOTH
def test_a_reply_stops_at_the_end_of_turn_token(tokenizer, make):
    gemma = make(GEMMA_TOKENS)
    chat_format.apply(gemma, "gemma3")
    session = session_with(tokenizer, gemma)
    scripted(session, ["<start_of_turn>", "hello", "<end_of_turn>", "user", "hi", "hi"])
    settings = GenerationSettings(greedy=True, max_new_tokens=6)
    *_, finished = session.generate(CONVERSATION[1:2], settings, ProbeSettings.off())
    assert finished.reason == "eos"
    assert finished.generated_tokens == 3
    assert "user" not in finished.text


@BOTH
def test_the_plain_transcript_stops_where_the_model_starts_the_users_turn(tokenizer, make):
    session = session_with(tokenizer, make(("<bos>", "<eos>")))
    scripted(session, ["hello", "there", "\n", "user", ":", "hi", "hi"])
    settings = GenerationSettings(greedy=True, max_new_tokens=7)
    *_, finished = session.generate(CONVERSATION[1:2], settings, ProbeSettings.off())
    assert finished.reason == "stop_string"
    assert finished.text == "hellothere"
    scripted(session, ["hello", "\n", "assistant", ":", "hello", "hi", "hi"])  # a turn again
    *_, finished = session.generate(CONVERSATION[1:2], settings, ProbeSettings.off())
    assert (finished.reason, finished.text) == ("stop_string", "hello")
    # Completion mode continues text as written: no turns, no stop string added.
    scripted(session, ["hello", "\n", "user", ":", "hi"])
    completion = replace(settings, completion=True, max_new_tokens=5)
    *_, finished = session.generate(CONVERSATION[1:2], completion, ProbeSettings.off())
    assert finished.reason == "length"
    assert finished.text == "hello\nuser:hi"


@pytest.mark.parametrize(
    ("metadata", "stem", "tuned"),
    [
        ({"general.finetune": "Instruct-GGUF"}, "model", True),
        ({"general.name": "Qwen2.5 Coder 1.5B Instruct"}, "model", True),
        ({"general.name": "gemma 3 270m"}, "gemma-3-270m-it-Q4_K_M", True),
        ({"general.name": "Gemma 3 270m"}, "gemma-3-270m-q4_k_m", False),  # the base model
        ({}, "tinyllama-chat", True),
        ({"general.name": "Llama 3.2 1B"}, "unit-test", False),  # "it" inside a word: no
    ],
)
def test_only_a_gguf_that_says_it_was_tuned_to_chat_gets_a_guessed_template(
    tmp_path, metadata, stem, tuned
):
    import gguf

    from engine.load.loader import instruction_tuned

    path = tmp_path / f"{stem}.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, value in metadata.items():
        writer.add_string(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert instruction_tuned(path) is tuned
