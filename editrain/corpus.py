"""The configured corpus: the token cache of a :class:`~editrain.config.Config`, and its report.

One call, :func:`prepare_data`, is shared by the launcher (which tokenises once before
spawning workers), every worker and ``editrain data``; :func:`describe_data` is what
``editrain data`` prints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from editrain.config import Config
from editrain.config.model import tokenizer_source
from editrain.data import OVERLAP_WINDOW, TokenData, open_prepared, prepare_tokens
from editrain.data.sources import DEFAULT_SOURCE

__all__ = ["describe_data", "format_data", "prepare_data"]


def prepare_data(cfg: Config, entry: str | Path | None = None) -> TokenData:
    """Build (or reuse) the token cache that ``cfg.data`` describes (a progress bar on a
    terminal when the build is slow, unless ``cfg.quiet``).

    Args:
        cfg: the configuration.
        entry: the cache entry the launcher prepared for this job
            (:attr:`TokenData.cache_dir`), opened as it is (:func:`editrain.data.open_prepared`);
            if it is gone, the cache is looked up as without it.
    """
    if entry is not None:
        data = open_prepared(entry)
        if data is not None:
            return data
    d = cfg.data
    # data.tokenizer may be a model directory (or come from model.init_from's): its
    # tokenizer.json, and the end-of-text token its tokenizer_config.json names.
    tokenizer, _, eos_token = tokenizer_source(cfg)
    return prepare_tokens(
        d.path, Path(d.cache_dir).expanduser(), d.vocab_size, tokenizer, d.val_fraction,
        corpus_bytes(d), val_tokens=d.val_tokens, split_seed=d.split_seed,
        text_field=d.text_field, eos_token=eos_token, eos=d.eos, separator=d.separator,
        progress=not cfg.quiet,
    )


DEFAULT_CORPUS_BYTES = 8_000_000
"""What ``data.max_bytes = "auto"`` reads of the embedded default corpus (the running
Python's standard library: the main job and the benchmarks train on this slice)."""


def corpus_bytes(d: Any) -> int | None:
    """The cap ``data.max_bytes`` puts on the corpus (None: all of it): ``auto`` reads all
    of a corpus ``data.path`` names (a user's corpus is never cut short unasked) and
    :data:`DEFAULT_CORPUS_BYTES` of the embedded default one."""
    if d.max_bytes == "auto":  # a list holding the default corpus: capped as it was
        paths = [d.path] if isinstance(d.path, str) else list(d.path)
        return DEFAULT_CORPUS_BYTES if DEFAULT_SOURCE in paths else None
    return d.max_bytes


def describe_data(data: TokenData) -> dict[str, Any]:
    """The splits of a prepared corpus, as plain data (what ``editrain data --json`` prints).

    Returns:
        ``cache_dir``, ``reused``, ``vocab_size``, ``split`` (documents or tail),
        ``documents``, per split its ``tokens``, ``documents`` and bytes/documents per kind,
        the share of validation windows seen in training (``val_train_overlap``) and the
        window length, and whether the tokenizer was trained on the training split only.
    """
    meta = data.meta
    kinds = meta.get("kinds", {})
    return {
        "cache_dir": str(data.cache_dir),
        "reused": data.reused,
        "vocab_size": data.vocab_size,
        "tokenizer": meta.get("tokenizer"),
        "tokenizer_trained_on": meta.get("tokenizer_trained_on"),
        "split": meta.get("split"),
        "documents": meta.get("documents"),
        "duplicates_dropped": kinds.get("duplicates_dropped", 0),
        "groups": meta.get("groups"),
        "train": {"tokens": int(len(data.train)), "kinds": kinds.get("train", {})},
        "val": {"tokens": int(len(data.val)), "documents": meta.get("val_documents"),
                "kinds": kinds.get("val", {})},
        "overlap_window": OVERLAP_WINDOW,
        "val_train_overlap": meta.get(f"val_train_overlap_{OVERLAP_WINDOW}"),
    }


def format_data(info: dict[str, Any]) -> str:
    """Human-readable lines of :func:`describe_data`'s result."""
    lines = [f"cache:     {info['cache_dir']} ({'reused' if info['reused'] else 'built'})",
             f"tokenizer: {info['tokenizer']}, vocab {info['vocab_size']}"
             + (f", trained on the {info['tokenizer_trained_on']} split"
                if info["tokenizer_trained_on"] else ""),
             f"documents: {info['documents']} ({info['duplicates_dropped']} exact duplicates "
             f"dropped, {info['groups']} families), split by {info['split']}"]
    for side in ("train", "val"):
        kinds = ", ".join(f"{k} {v['documents']} docs / {v['bytes'] / 1e6:.2f} MB"
                          for k, v in info[side]["kinds"].items())
        lines.append(f"{side + ':':<10} {info[side]['tokens']:>10,} tokens"
                     + (f"  ({kinds})" if kinds else ""))
    if info["val_train_overlap"] is not None:
        lines.append(f"overlap:   {100 * info['val_train_overlap']:.1f}% of validation "
                     f"{info['overlap_window']}-token windows occur in train.bin")
    return "\n".join(lines)
