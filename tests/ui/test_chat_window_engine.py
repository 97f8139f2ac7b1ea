"""The chat window on the real engine: a tiny random Llama and a byte-level tokenizer, built in
memory (no download), answered through the worker thread and ChatSession."""

from __future__ import annotations

import pytest
import torch
from PySide6.QtCore import Qt
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from app.worker import GenerationWorker
from engine.events import Finished, PrefillDone, Token
from engine.loader import LoadedModel, prepare
from engine.session import ChatSession
from engine.settings import GenerationSettings, LoadRequest, Message
from ui.main_window import MainWindow

SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per byte plus the ChatML specials: encodes and decodes any text exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=SPECIALS[0], eos_token=SPECIALS[1], chat_template=CHATML
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tokenizer


@pytest.fixture(scope="module")
def tiny_llama() -> LoadedModel:
    torch.manual_seed(0)
    tokenizer = byte_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
    )
    return prepare(LlamaForCausalLM(config), tokenizer, name="tiny-llama", source="folder")


def test_a_real_session_streams_a_reply_into_the_window(qtbot, qsettings, tiny_llama):
    worker = GenerationWorker(
        loader=lambda request, progress: tiny_llama, session_factory=ChatSession
    )
    window = MainWindow(worker, settings=qsettings)
    qtbot.addWidget(window)
    window.settings_panel.set_settings(GenerationSettings(greedy=True, max_new_tokens=24))
    events: list = []
    window.event_received.connect(events.append)
    try:
        with qtbot.waitSignal(worker.loaded, timeout=10_000):
            window.load_model(LoadRequest("tiny"))
        qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
        assert window.model_label.text().startswith("tiny-llama · cpu · exact float32 · ")

        qtbot.keyClicks(window.input, "Hello, tiny model")
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: not worker.busy and not window.chat.replying, timeout=30_000)
    finally:
        worker.shutdown()

    assert isinstance(events[0], PrefillDone) and isinstance(events[-1], Finished)
    finished = events[-1]
    tokens = [e for e in events if isinstance(e, Token)]
    assert finished.reason in ("eos", "length")
    assert len(tokens) == finished.generated_tokens >= 1
    assert "".join(t.text for t in tokens) == finished.text
    assert finished.prompt_tokens == events[0].prompt_tokens > len("Hello, tiny model")
    assert window.conversation() == [
        Message("user", "Hello, tiny model"),
        Message("assistant", finished.text),
    ]
    assert window.speed_label.text().startswith(f"TTFT {finished.ttft_s:.2f} s")
