"""Data pipeline: text sources, tokenizer, token cache and per-rank samplers.

This package is a leaf layer: it depends on numpy, torch and ``tokenizers``
only, never on other ``editrain`` packages or ``torch.distributed`` (ranks and
world size are plain ints passed in by the caller).
"""

from .dataset import FORMAT_VERSION, TokenData, prepare_tokens, token_dtype
from .sampler import SequenceStream, val_batches
from .sources import (
    DEFAULT_SOURCE,
    TEXT_EXTENSIONS,
    SourceRef,
    iter_documents,
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
