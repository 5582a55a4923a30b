"""Tokenizers: train a small byte-level BPE, or load a user's ``tokenizer.json``.

Byte-level BPE is used because it can encode any UTF-8 text without an unknown
token: the 256 byte symbols are always in the vocabulary, so
``decode(encode(s)) == s`` holds for every string.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from editrain.errors import plain_scalar, require
from editrain.paths import shown

__all__ = [
    "EOS_TOKEN",
    "EOS_FALLBACK_TOKENS",
    "MIN_VOCAB_SIZE",
    "check_vocab_size",
    "train_bpe_tokenizer",
    "load_tokenizer",
    "eos_id",
    "tokenizer_vocab_size",
    "tokenizer_json_hash",
]

EOS_TOKEN = "<|endoftext|>"

# Tried in order by eos_id() when no explicit name is given, so that common
# pretrained tokenizers (GPT-2, Llama 2, Llama 3, Gemma) work out of the box.
EOS_FALLBACK_TOKENS = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")

# 256 byte symbols plus the end-of-text special token.
MIN_VOCAB_SIZE = 257

# Documents are handed to the trainer in lists of this many; batches let the
# Rust side parallelise instead of crossing the Python boundary per document.
_TRAIN_BATCH = 256


def _batched(docs: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def check_vocab_size(vocab_size: Any) -> int:
    """``data.vocab_size`` as a plain ``int`` of at least :data:`MIN_VOCAB_SIZE`, checked as
    the configuration checks the option (:func:`editrain.errors.plain_scalar`: numpy
    integers taken, a bool or float refused) and worded as it words it.

    Raises:
        ConfigError: (a ``ValueError``) naming ``data.vocab_size``.
    """
    vocab_size = plain_scalar(vocab_size, int, "data.vocab_size")
    require(vocab_size >= MIN_VOCAB_SIZE, "data.vocab_size",
            f"must be >= {MIN_VOCAB_SIZE} (256 bytes + end-of-text), got {vocab_size}")
    return vocab_size


def train_bpe_tokenizer(docs: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``docs``.

    The special token ``<|endoftext|>`` gets id 0 and separates documents in
    the token stream. Ids 1..256 are the byte alphabet, so the vocabulary is
    complete even for bytes the corpus never contains.

    Args:
        docs: Training texts; consumed once.
        vocab_size: Target vocabulary size including the special token and the
            256 byte symbols. A small corpus may yield fewer tokens (BPE stops
            when no pair is left to merge); use ``get_vocab_size()`` on the
            result for the real size.

    Returns:
        The trained :class:`tokenizers.Tokenizer`.

    Raises:
        ValueError: ``vocab_size`` is below 257 (message names ``data.vocab_size``).
    """
    vocab_size = check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps the round trip exact: with True, a leading
    # space would be invented in front of every text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_batched(docs, _TRAIN_BATCH), trainer=trainer)
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer saved as a HF ``tokenizer.json``.

    Args:
        path: Path of the ``tokenizer.json`` file (``~`` is expanded).

    Returns:
        The loaded :class:`tokenizers.Tokenizer`.

    Raises:
        FileNotFoundError: The file does not exist (message names ``data.tokenizer``).
        ValueError: The file is not a valid tokenizer definition.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"data.tokenizer: {shown(str(p))} does not exist (expected a tokenizer.json file)"
        )
    try:
        return Tokenizer.from_file(str(p))
    except Exception as exc:  # the Rust side raises a bare Exception on bad JSON
        raise ValueError(
            f"data.tokenizer: {shown(str(p))} is not a valid tokenizer.json ({exc})"
        ) from exc


def eos_id(tok: Tokenizer, eos_token: str | None = None) -> int:
    """Id of the end-of-text token used to separate documents.

    With ``eos_token=None`` the names in :data:`EOS_FALLBACK_TOKENS` are tried
    in order (``<|endoftext|>`` first, which is what :func:`train_bpe_tokenizer`
    creates); with an explicit name only that token is accepted.

    Args:
        tok: The tokenizer.
        eos_token: Name of the separator token, or ``None`` to auto-detect.

    Returns:
        The token id.

    Raises:
        ValueError: No matching token exists in the tokenizer's vocabulary.
    """
    names = (eos_token,) if eos_token is not None else EOS_FALLBACK_TOKENS
    for name in names:
        tid = tok.token_to_id(name)
        if tid is not None:
            return int(tid)
    raise ValueError(
        "data.tokenizer has no end-of-text token to separate documents; it needs one of "
        f"{', '.join(names)} in its vocabulary (add it as a special token)"
    )


def tokenizer_vocab_size(tok: Tokenizer) -> int:
    """Size of the id space of ``tok``: one more than its largest id.

    ``get_vocab_size`` can under-count when added tokens leave gaps in the id
    range, and the embedding table must cover the largest id.

    Args:
        tok: The tokenizer.

    Returns:
        The number of ids an embedding table needs.
    """
    vocab = tok.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0


def tokenizer_json_hash(path: str | Path) -> str:
    """sha256 of a tokenizer file's bytes, used as its identity in cache keys.

    Args:
        path: Path of the ``tokenizer.json`` file.

    Returns:
        Hex digest.
    """
    return hashlib.sha256(Path(path).expanduser().read_bytes()).hexdigest()
