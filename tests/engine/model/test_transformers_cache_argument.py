"""The KV cache reaches transformers models under the name their version takes: `cache` since
transformers 5.24 (`past_key_values` warns there, removal announced for 5.40), `past_key_values`
before (5.17, the GPU machines' version). No FutureWarning may reach the chat."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from engine.model.decoder import cache_kwarg, decoder_for
from tests.models import make_tiny


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_a_cached_forward_and_generate_warn_nothing(tokenizer, architecture):
    tiny = make_tiny(tokenizer, architecture)
    decoder = decoder_for(tiny.model)
    ids = torch.tensor([tokenizer("Hello there")["input_ids"]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cache = decoder.new_cache()
        decoder.forward(ids, cache, None)  # the prompt
        decoder.forward(ids[:, -1:], cache, None)  # one step on the cache
        assert cache.layer_bytes()[0] > 0
        tiny.model.generate(  # the benchmark's reference
            ids, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )


def test_the_argument_is_the_name_the_models_forward_takes(tokenizer):
    model = make_tiny(tokenizer, "llama").model
    parameters = inspect.signature(model.forward).parameters
    assert cache_kwarg(model) in parameters

    class Old(torch.nn.Module):  # transformers 5.17-5.23
        def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...

    class New(torch.nn.Module):  # 5.24 on
        def forward(self, input_ids=None, cache=None, use_cache=None): ...

    assert cache_kwarg(Old()) == "past_key_values"
    assert cache_kwarg(New()) == "cache"


def test_the_old_name_would_warn_where_transformers_deprecates_it(tokenizer):
    """The check above can fail: the deprecated name does warn on this transformers."""
    model = make_tiny(tokenizer, "llama").model
    if cache_kwarg(model) != "cache":
        pytest.skip("this transformers takes only past_key_values")
    decoder = decoder_for(model)
    decoder.cache_kwarg = "past_key_values"
    ids = torch.tensor([tokenizer("Hello")["input_ids"]])
    with pytest.warns(FutureWarning, match="past_key_values"):
        decoder.forward(ids, decoder.new_cache(), None)
