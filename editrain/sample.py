"""editrain sample: text from a checkpoint or a Hugging Face directory, in one CPU process.

The model is editrain's own (its Llama, or a Hugging Face architecture through the adapter),
so what is sampled is what was trained: a checkpoint's global model (its anchors, or one
replica's weights), or a directory's safetensors read by the same loader as
``model.init_from``. Decoding is plain: greedy at temperature 0, else softmax sampling with an
optional top-k cut, from a seeded generator. The keys and values of the tokens already
seen are kept (a KV cache: editrain's :class:`~editrain.models.llama.KVCache`, or the
Hugging Face model's own), so each new token runs one position through the model, until the
text outgrows the model's window; from there the oldest tokens fall out and each new token
runs the whole window again.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from editrain.checkpoint import MARKER, open_checkpoint
from editrain.config.size import check_weights_match
from editrain.hf_checkpoint import (
    RUN_TOKENIZER_DIR,
    build_checked,
    checkpoint_model,
    find_checkpoint,
    load_hf_weights,
    marker_model,
    model_weights,
    tied_aliases,
)
from editrain.models.hf import HFCausalLM
from editrain.models.hf_dir import (
    HUB_PREFIX,
    hf_int,
    hub_snapshot,
    inspect_weights,
    read_config,
    special_tokens,
    tokenizer_file,
)
from editrain.models.hf_llama import is_llama_config, llama_config_from_hf
from editrain.models.llama import KVCache, Llama, fill_rope
from editrain.paths import shown

__all__ = ["Loaded", "continuation", "generate", "load_for_sampling"]


@dataclass
class Loaded:
    """A model ready to sample from, its tokenizer and where they came from."""

    model: nn.Module
    tokenizer: Any
    eos_id: int | None
    max_len: int
    source: str


def _hf_dir_model(path: Path) -> tuple[nn.Module, int]:
    data = read_config(path, option="sample")
    weights = inspect_weights(path, option="sample")
    check_weights_match(data, weights.tensors, shown(path / "config.json"), option="sample")
    shapes = {n: t.shape for n, t in weights.tensors.items()}
    if is_llama_config(data):
        cfg = llama_config_from_hf(data, f"sample: {shown(path / 'config.json')}")
        # every weight comes from the directory: no seeded build first
        model: nn.Module = build_checked(lambda: Llama(cfg), shapes, shown(path), "sample",
                                         real=False).to_empty(device="cpu")
        fill_rope(model)
        max_len = cfg.max_seq_len
    else:
        model = build_checked(lambda: HFCausalLM.from_config_dict(data, path=path, option="sample"), shapes,
                              shown(path), "sample")
        max_len = hf_int(data, "positions") or 2048
    load_hf_weights(model, path, weights)
    return model, max_len


def _checkpoint_model(path: Path, replica: int | None) -> tuple[nn.Module, int, Path, str]:
    ckpt, replica = find_checkpoint(path, option="sample", replica=replica)
    marker = open_checkpoint(ckpt)  # regular files only, no link, bounded marker
    weights = model_weights(ckpt, replica, "sample", marker)
    # editrain's Llama stays on the meta device and takes the checkpoint's tensors as its
    # parameters (no seeded build, no second copy); a Hugging Face model is built (its
    # rotary tables are buffers of its own) and the tensors copied in
    llama = marker_model(marker)[0]
    model, max_len = checkpoint_model(marker, weights.meta, ckpt, "sample", real=not llama)
    tensors = weights.load()  # once the model they describe fits them
    # strict=False only for what the tensors hold once: a tied parameter's other name (a
    # Hugging Face model's head); every tensor of the checkpoint must land on a parameter.
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=llama)
    if unexpected or set(missing) - set(tied_aliases(model)):
        raise ValueError(f"sample: {shown(ckpt)} does not fit its own model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    if llama:
        fill_rope(model, "cpu")
    return model, max_len, ckpt.parent.parent / RUN_TOKENIZER_DIR, f"{ckpt}: {weights.source}"


def load_for_sampling(path: str | Path, replica: int | None = None) -> Loaded:
    """The model and tokenizer of a checkpoint (or run directory) or a Hugging Face
    directory.

    Raises:
        ValueError, CheckpointError: one line naming ``sample``: not a checkpoint or model
            directory, no tokenizer, a model that does not fit its weights.
    """
    from tokenizers import Tokenizer

    if str(path).startswith(HUB_PREFIX):  # a model of the Hugging Face hub cache
        path = hub_snapshot(str(path), "sample")
    p = Path(path).expanduser()
    if (p / "config.json").is_file() and not (p / MARKER).is_file():
        if replica is not None:
            raise ValueError("sample --replica: only for a checkpoint, not a model directory")
        model, max_len = _hf_dir_model(p)
        tok_dir, source = p, str(p)
    else:
        model, max_len, tok_dir, source = _checkpoint_model(p, replica)
    tok_path = tokenizer_file(tok_dir)
    if tok_path is None:
        raise ValueError(f"sample: no tokenizer.json in {shown(tok_dir)}")
    tokenizer = Tokenizer.from_file(str(tok_path))
    eos_text = special_tokens(tok_dir).get("eos")
    eos = tokenizer.token_to_id(eos_text) if eos_text else None
    return Loaded(model.eval(), tokenizer, eos, max_len, source)


@torch.no_grad()
def generate(model: nn.Module, prompt: list[int], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0,
             eos_id: int | None = None, max_len: int = 2048) -> list[int]:
    """Continue ``prompt`` by up to ``max_new_tokens`` token ids.

    Args:
        model: maps ``[1, T]`` ids to logits ``[1, T, V]``.
        prompt: the prompt's ids (at least one).
        temperature: 0: the most likely token each time; > 0: sample from
            ``softmax(logits / temperature)``.
        top_k: > 0: sample only among the ``top_k`` most likely tokens.
        seed: seed of the sampling generator (the same seed, the same text).
        eos_id: stop after this token.
        max_len: the model's longest window; older tokens fall out of it.

    Returns:
        The new ids (without the prompt).

    Raises:
        ValueError: an empty prompt, or a negative count, temperature or top-k.
    """
    if not prompt:
        raise ValueError("sample --prompt: the prompt encodes to no token")
    if max_new_tokens < 0 or temperature < 0 or top_k < 0:
        raise ValueError("sample: --max-new-tokens, --temperature and --top-k must be >= 0")
    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    new: list[int] = []
    decoder = _Decoder(model, max_len)
    for _ in range(max_new_tokens):
        logits = decoder.next_logits(ids)
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            probs = _probabilities(logits, temperature, top_k)
            nxt = int(torch.multinomial(probs, 1, generator=gen))
        ids.append(nxt)
        new.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
    return new


def _probabilities(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """``softmax(logits / temperature)`` over the ``top_k`` most likely tokens (all at 0).

    The logits are shifted so that the largest is 0 before the division (the softmax is
    the same), in float64 (a Python float, every temperature is a positive float64): a
    tiny temperature (``1e-40``, ``1e-300``) then makes the others -inf and samples the
    most likely token, where every logit became inf, or 0 / 0 where the temperature
    rounded to a float32 0 (NaN probabilities, a traceback). The top-k cut is found on the logits themselves (a
    positive temperature keeps their order) and applied after the division, so an
    infinite temperature samples uniformly among the ``top_k`` (the division turned the
    logits into zeros, which the cut then kept)."""
    scaled = (logits.double() - logits.max()) / temperature
    if 0 < top_k < logits.numel():
        cut = torch.topk(logits, top_k).values[-1]
        scaled = scaled.masked_fill(logits < cut, float("-inf"))
    return torch.softmax(scaled, -1)


def continuation(tokenizer: Any, prompt: list[int], new: list[int]) -> str:
    """The text of ``new`` as it reads after ``prompt``: the decoded whole less the decoded
    prompt.

    A tokenizer's decoder is not made to decode a continuation on its own: a SentencePiece
    style one (Llama 2, Mistral, T5: ``▁`` for a space, Metaspace or a Strip step) drops
    the first token's space as the start of a text, so ``Once upon a`` and ``▁time`` read
    ``Once upon atime``. Decoding the whole keeps what the tokens mean at that position;
    should the whole not begin with the prompt's own text (no decoder known here does
    that), the new tokens are decoded alone as before."""
    head, whole = tokenizer.decode(prompt), tokenizer.decode(prompt + new)
    return whole[len(head):] if whole.startswith(head) else tokenizer.decode(new)


class _Decoder:
    """Next-token logits of a growing text, with a KV cache where the model has one
    (editrain's Llama, a Hugging Face model through the adapter): the first call runs the
    prompt, each later one only the tokens added since. Once the text is longer than the
    window (``max_len``), each call runs the last ``max_len`` tokens from scratch."""

    def __init__(self, model: nn.Module, max_len: int) -> None:
        self.model, self.max_len = model, max_len
        self.cache: Any = None
        # a Hugging Face model's cache argument: ``cache`` in transformers 5, before
        # ``past_key_values`` (looked up once, not at every token)
        self.cache_arg = ("cache" if isinstance(model, HFCausalLM) and "cache" in
                          inspect.signature(model.hf.forward).parameters else "past_key_values")
        self.seen = 0
        """Tokens the cache holds (the text's first ``seen``)."""

    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """The logits ``[V]`` (float32) of the token after ``ids``."""
        if len(ids) > self.max_len or not isinstance(self.model, Llama | HFCausalLM):
            window = torch.tensor([ids[-self.max_len:]], dtype=torch.long)
            return self.model(window)[0, -1].float()
        fresh = torch.tensor([ids[self.seen:]], dtype=torch.long)
        if isinstance(self.model, Llama):
            if self.cache is None:
                self.cache = KVCache(len(self.model.layers))
            logits = self.model(fresh, cache=self.cache)
        else:  # the Hugging Face model's own cache
            out = self.model.hf(input_ids=fresh, use_cache=True, **{self.cache_arg: self.cache})
            logits, self.cache = out.logits, out[self.cache_arg]
        self.seen = len(ids)
        return logits[0, -1].float()
