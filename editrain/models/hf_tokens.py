"""The bos/eos/pad ids a Hugging Face config names, a tokenizer's, checked against a vocabulary.

transformers reads ``bos_token_id`` / ``eos_token_id`` / ``pad_token_id`` from
``config.json`` (and ``generation_config.json``) and takes a config class's default for a
field the file does not name (Llama's 1 and 2, GPT-2's 50256). An export writes the ids of
the model directory a run started from as that directory names them, where its tokenizer
is that directory's; else all three of the tokenizer's own, ``null`` where it names no such
token, so that no class default stands for one.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from editrain.models.hf_dir import read_config, special_tokens
from editrain.paths import shown
from editrain.safe_io import quote, read_json_value

__all__ = ["GENERATION_FILE", "TOKEN_ID_KEYS", "check_kept_ids", "check_special_ids",
           "config_special_ids", "tokenizer_special_ids"]

GENERATION_FILE = "generation_config.json"
"""How a model generates (its end-of-text ids among its settings), beside ``config.json``."""

TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
"""The special-token ids of a config, in ``config.json``'s and ``generation_config.json``'s
names."""


def config_special_ids(config: Mapping[str, Any]) -> dict[str, Any]:
    """The special-token ids a ``config.json`` names (``null`` included): written back as
    they are, they load as they did, the class's defaults standing in for the others."""
    return {key: config[key] for key in TOKEN_ID_KEYS if key in config}


def tokenizer_special_ids(tok_dir: str | Path) -> dict[str, int | None]:
    """The ids of the special tokens a tokenizer directory names (``tokenizer_config.json``,
    else ``special_tokens_map.json``), ``None`` for a kind it names none of: what
    ``AutoTokenizer`` gives for them, nothing made up.

    Raises:
        ValueError: a special token its ``tokenizer.json`` does not hold (``AutoTokenizer``
            would add it, at an id past the model's vocabulary).
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(tok_dir) / "tokenizer.json"))
    ids: dict[str, int | None] = dict.fromkeys(TOKEN_ID_KEYS)
    for kind, text in special_tokens(tok_dir).items():
        tid = tok.token_to_id(text)
        if tid is None:
            raise ValueError(f"{shown(tok_dir)}: its tokenizer files name the {kind} token {quote(text)}, "
                             f"which its tokenizer.json does not hold; name a token of its "
                             f"vocabulary")
        ids[f"{kind}_token_id"] = int(tid)
    return ids


def _is_id(value: Any, vocab_size: int) -> bool:
    """An integer id of the vocabulary (any non-negative one where ``vocab_size`` is 0)."""
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return value >= 0 and (not vocab_size or value < vocab_size)


def check_special_ids(ids: Mapping[str, Any], vocab_size: int, where: str | Path) -> None:
    """Every id of ``ids`` is ``null`` or a token of the model's vocabulary (a non-empty
    list of them for ``eos_token_id``, as Llama 3 names several).

    Args:
        ids: :data:`TOKEN_ID_KEYS` (or some of them) -> the value to write.
        vocab_size: the model's vocabulary (its embedding's rows); 0: not known, then an
            id is only checked to be a non-negative integer.
        where: the file the ids came from, for the message (spelled by
            :func:`editrain.paths.shown`).

    Raises:
        ValueError: one line naming ``where``, the field, its value and what is allowed.
    """
    for key in TOKEN_ID_KEYS:
        value = ids.get(key)
        if value is None or _is_id(value, vocab_size):
            continue
        if (key == "eos_token_id" and isinstance(value, list) and value
                and all(_is_id(v, vocab_size) for v in value)):
            continue
        ids_of = f"0 to {vocab_size - 1}" if vocab_size else "a non-negative integer"
        lists = ", or a non-empty list of such ids" if key == "eos_token_id" else ""
        raise ValueError(f"{shown(where)}: {key} is {quote(value)}, not a token of the model's "
                         "vocabulary "
                         f"(an id from {ids_of}{lists}, or null)")


def _same_dir(a: str | Path | None, b: str | Path | None) -> bool:
    """Whether two paths name the same directory (neither None)."""
    return (a is not None and b is not None
            and Path(a).expanduser().resolve() == Path(b).expanduser().resolve())


def check_kept_ids(tok_dir: str | Path | None, model_dir: str | Path | None,
                   vocab_size: int, option: str) -> None:
    """The special-token ids a run keeps for its export, checked before it trains: what
    ``editrain export`` would refuse after the whole run (the directory's own ids where
    the tokenizer is the ``model.init_from`` directory's, a ``generation_config.json``
    kept as it is, the special tokens a tokenizer directory names), refused at once.

    Args:
        tok_dir: the directory the run's tokenizer comes from (``data.tokenizer``, or the
            ``model.init_from`` directory); None: a ``tokenizer.json`` alone or a BPE
            editrain trains, whose ids are the tokenizer's own.
        model_dir: the ``model.init_from`` directory, or None.
        vocab_size: the model's vocabulary (its embedding's rows).
        option: the option that chose the files, which the message names first.

    Raises:
        ValueError: one line naming ``option``, the file, the field and what is allowed.
    """
    if tok_dir is None:
        return
    try:
        _check_kept_ids(tok_dir, model_dir, vocab_size)
    except ValueError as e:
        raise ValueError(f"{option}: {e}; editrain export writes these ids for transformers "
                         f"to read, and would refuse them after training: correct the "
                         f"file") from None


def _check_kept_ids(tok_dir: str | Path, model_dir: str | Path | None,
                    vocab_size: int) -> None:
    """:func:`check_kept_ids` without the option's name."""
    if _same_dir(tok_dir, model_dir):
        config = read_config(model_dir)
        check_special_ids(config_special_ids(config), vocab_size,
                          str(Path(model_dir) / "config.json"))
    else:
        tokenizer_special_ids(tok_dir)
    # the generation config kept as it is: the model directory's, else the tokenizer's
    # (one from a model directory beside another tokenizer takes that tokenizer's ids)
    for where in (model_dir, tok_dir):
        path = None if where is None else Path(where) / GENERATION_FILE
        if path is not None and path.is_file():
            if _same_dir(where, tok_dir):
                value = read_json_value(path.read_bytes(), shown(path), error=ValueError)
                if not isinstance(value, dict):
                    raise ValueError(f"{shown(path)} is not a JSON object")
                check_special_ids(value, vocab_size, str(path))
            return
