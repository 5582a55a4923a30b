"""Data pipeline: text sources, tokenizer, token cache and per-rank samplers.

This package is a leaf layer: it depends on numpy, torch, ``tokenizers`` and ``rich`` (the
progress bar of slow builds), optionally ``pyarrow`` and ``datasets`` (``.parquet`` files and
Hugging Face datasets), never on other ``editrain`` packages or ``torch.distributed`` (ranks
and world size are plain ints passed in by the caller).
"""

from .dataset import (
    DEFAULT_VAL_TOKENS,
    EOS_POLICIES,
    FORMAT_VERSION,
    OVERLAP_WINDOW,
    TokenData,
    check_data_options,
    open_prepared,
    prepare_tokens,
    token_dtype,
)
from .overlap import window_overlap
from .sampler import EvalBatch, SequenceStream, check_batch_size, eval_batches, val_batches
from .sources import (
    DEFAULT_SOURCE,
    HF_FAMILY_ROWS,
    SUPPORTED_SOURCES,
    TEXT_EXTENSIONS,
    Document,
    SourceRef,
    iter_documents,
    iter_records,
    parse_sources,
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
    "EOS_POLICIES",
    "EOS_TOKEN",
    "FORMAT_VERSION",
    "HF_FAMILY_ROWS",
    "MIN_VOCAB_SIZE",
    "SUPPORTED_SOURCES",
    "TEXT_EXTENSIONS",
    "SequenceStream",
    "SourceRef",
    "TokenData",
    "check_batch_size",
    "check_data_options",
    "eos_id",
    "iter_documents",
    "load_tokenizer",
    "open_prepared",
    "parse_sources",
    "prepare_tokens",
    "resolve_sources",
    "source_fingerprint",
    "token_dtype",
    "tokenizer_json_hash",
    "tokenizer_vocab_size",
    "train_bpe_tokenizer",
    "val_batches",
]
