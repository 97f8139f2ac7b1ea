"""Models the engine process builds by name in tests (app.server.engine_spec.EngineSpec): a tiny
random Llama with a byte-level tokenizer, made in memory in well under a second."""

from __future__ import annotations

SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """One token per byte plus the ChatML specials: encodes and decodes any text exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

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


def tiny_llama(request, progress):
    """A loader: a 2-layer random Llama named "tiny-llama" (request.spec is ignored)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.load.loader import prepare

    progress("Building the tiny model", 0.5)
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
    loaded = prepare(LlamaForCausalLM(config), tokenizer, name="tiny-llama", source="memory")
    progress("Ready", 1.0)
    return loaded


def compiled_fast_session(loaded):
    """A session factory: the fake session as a fast model whose compiled decode step is
    attached (or failed to be, when the load request's extra names an error)."""
    import threading
    from dataclasses import replace
    from types import SimpleNamespace

    from tests.ui.fakes import process_session

    session = process_session(loaded)
    session.info = replace(session.info, precision="fast")
    done = threading.Event()
    done.set()
    state = "compiled" if loaded.error is None else f"eager: {loaded.error}"  # Attacher.state
    session.compiling = SimpleNamespace(done=done, state=state)
    return session


def loader_with_error(request, progress):
    """process_loader, with request.extra["error"] kept for compiled_fast_session."""
    from tests.ui.fakes import process_loader

    loaded = process_loader(request, progress)
    loaded.error = request.extra.get("error")
    return loaded


def thread_counting_session(loaded):
    """The fake session, whose Finished text says torch's thread counts "prefill,decode" (read
    as its prompt is processed and as its last token is made), then the process's niceness
    and its $GOMP_SPINCOUNT: "prefill,decode,niceness,spin"."""
    import os
    from dataclasses import replace

    import torch

    from engine.events import Finished
    from tests.ui.fakes import process_session

    session = process_session(loaded)
    generate = session.generate

    def counting(messages, settings, probes=None):
        prefill = torch.get_num_threads()  # the first next(): up to PrefillDone
        for event in generate(messages, settings, probes):
            if isinstance(event, Finished):
                spin = os.environ.get("GOMP_SPINCOUNT")
                seen = (prefill, torch.get_num_threads(), os.nice(0), spin)
                event = replace(event, text=",".join(map(str, seen)))
            yield event

    session.generate = counting
    return session
