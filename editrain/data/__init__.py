"""Data pipeline: text sources, tokenizer, token cache and per-rank samplers.

This package is a leaf layer: it depends on numpy, torch and ``tokenizers``
only, never on other ``editrain`` packages or ``torch.distributed`` (ranks and
world size are plain ints passed in by the caller).
"""

from .dataset import (
    DEFAULT_VAL_TOKENS,
    FORMAT_VERSION,
    OVERLAP_WINDOW,
    TokenData,
    prepare_tokens,
    token_dtype,
)
from .overlap import window_overlap
from .sampler import EvalBatch, SequenceStream, eval_batches, val_batches
from .sources import (
    DEFAULT_SOURCE,
    TEXT_EXTENSIONS,
    Document,
    SourceRef,
    iter_documents,
    iter_records,
    resolve_sources,
    source_fingerprint,
)
from .tokenizer import (
    EOS_FALLBACK_TOKENS,
    EOS_TOKEN,
    MIN_VOCAB_SIZE,
    eos_id,
    load_tokenizer,
    tokenizer_json_hash,
    tokenizer_vocab_size,
    train_bpe_tokenizer,
)

__all__ = [
    "DEFAULT_SOURCE",
    "DEFAULT_VAL_TOKENS",
    "Document",
    "EvalBatch",
    "OVERLAP_WINDOW",
    "eval_batches",
    "iter_records",
    "window_overlap",
    "EOS_FALLBACK_TOKENS",
    "EOS_TOKEN",
    "FORMAT_VERSION",
    "MIN_VOCAB_SIZE",
    "TEXT_EXTENSIONS",
    "SequenceStream",
    "SourceRef",
    "TokenData",
    "eos_id",
    "iter_documents",
    "load_tokenizer",
    "prepare_tokens",
    "resolve_sources",
    "source_fingerprint",
    "token_dtype",
    "tokenizer_json_hash",
    "tokenizer_vocab_size",
    "train_bpe_tokenizer",
    "val_batches",
]
