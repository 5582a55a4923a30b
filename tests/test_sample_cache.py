"""``editrain sample``'s KV cache: the logits of every decoding step equal the whole window's
run again (what sampling did before it had a cache), for editrain's Llama and for a Hugging
Face architecture through the adapter, before and after the text outgrows the window.

Tolerance (tests/README.md class 2, the same model in another order): a cached step
multiplies one position's query by the cached keys where the whole-window run multiplies
T queries at once, so its float32 sums round differently; the logits are of order 1 and
differ by a few ulps (2e-6 and below seen). ``CACHE_ATOL`` = 1e-5 is 80 ulps at 1: a wrong
position (RoPE of position 0 for every new token) or a mask that hides a cached key moves
logits by 1e-2 and more, as the test's own control shows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from editrain.models.llama import KVCache, Llama, LlamaConfig
from editrain.sample import _Decoder, generate

CACHE_ATOL = 1e-5


class _NoCache(nn.Module):
    """The model behind a type the decoder does not know: every step runs the window."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.inner = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens)


def _llama(max_len: int = 24) -> Llama:
    cfg = LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=97,
                      ffn_hidden=48, max_seq_len=max_len)
    return Llama(cfg, seed=3).eval()


def _steps(model: nn.Module, ids: list[int], max_len: int) -> list[torch.Tensor]:
    """The decoder's logits after each prefix of ``ids`` from its fifth token on."""
    decoder = _Decoder(model, max_len)
    with torch.no_grad():
        return [decoder.next_logits(ids[:n]) for n in range(5, len(ids) + 1)]


def _assert_steps_equal(model: nn.Module, max_len: int, length: int) -> None:
    ids = torch.randint(0, 97, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    cached, whole = _steps(model, ids, max_len), _steps(_NoCache(model), ids, max_len)
    assert len(cached) == len(whole) == length - 4
    for a, b in zip(cached, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=CACHE_ATOL)


def test_llama_cached_steps_equal_the_whole_window():
    model = _llama(max_len=24)
    _assert_steps_equal(model, 24, length=24)  # up to the full window
    _assert_steps_equal(model, 24, length=40)  # then past it: the window slides


def test_several_new_tokens_after_cached_ones_see_every_earlier_position():
    """The causal mask of queries that follow cached keys (prompt, then a chunk)."""
    model = _llama()
    ids = torch.randint(0, 97, (1, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(ids)
        cache = KVCache(len(model.layers))
        first, rest = model(ids[:, :4], cache=cache), model(ids[:, 4:], cache=cache)
        assert cache.length == 11
        torch.testing.assert_close(torch.cat([first, rest], 1), whole, rtol=0, atol=CACHE_ATOL)
        # the control: the same chunk without its cache (positions from 0) is far off
        assert (model(ids[:, 4:])[0, -1] - whole[0, -1]).abs().max() > 1e-2
    with pytest.raises(ValueError, match="sequence length 31 exceeds max_seq_len"):
        model(torch.zeros(1, 20, dtype=torch.long), cache=cache)  # 11 held + 20 > 24


def test_hugging_face_adapter_uses_the_models_own_cache(tmp_path):
    transformers = pytest.importorskip("transformers")
    from editrain.models.hf import HFCausalLM

    config = transformers.Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=24)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    model = HFCausalLM.from_config_file(tmp_path / "config.json").eval()
    _assert_steps_equal(model, 24, length=30)


def test_greedy_text_is_the_same_with_and_without_the_cache():
    model = _llama(max_len=24)
    prompt = [5, 17, 3]
    with torch.no_grad():
        assert generate(model, prompt, 40, max_len=24) == generate(
            _NoCache(model), prompt, 40, max_len=24)
