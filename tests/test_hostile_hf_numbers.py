"""The numbers of a Hugging Face model's files are read by one strict rule
(editrain.models.hf_fields): every bad value of every field editrain reads, through every
way a user hands over such a file (``model.init_from`` of a Llama and of another
architecture, ``model.hf_config``, ``editrain sample DIR``, a tokenizer directory), is
refused in one line naming the option, the file, the field and what is allowed, before
any model is built. Nothing here trains: validation only.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
from pathlib import Path

import pytest

from editrain.config import ConfigError, load_config
from editrain.paths import shown as shown_path

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face tests need the hf extra (pip install -e '.[hf]')")

SHAPE = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
HF_COUNT_MAX = 2**31 - 1
"""The largest count a config may give (editrain.models.hf_fields.HF_COUNT_MAX)."""
HF_LAYERS_MAX = 10**5
"""The most layers a config may give (editrain.models.hf_fields.HF_LAYERS_MAX)."""
BAD_COUNTS = ["true", "2.5", "2.0", '"4"', "[4]", "-1", "0", "1" + "0" * 30, "1e400", "NaN"]
"""Written as text into the JSON: ``1e400`` is what JSON readers make infinite."""
BAD_REALS = ["true", '"4"', "[4]", "-1", "0", "1e400", "NaN"]
BAD_FLAGS = ["0", "1", '"false"', "[true]", "2.5"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """A tiny LlamaForCausalLM and Qwen2ForCausalLM directory with a tokenizer each."""
    import torch

    from editrain.data.tokenizer import train_bpe_tokenizer
    from tests.test_examples import write_corpus

    root = tmp_path_factory.mktemp("hfnum")
    corpus = write_corpus(root / "corpus.txt", lines=200)
    tok = train_bpe_tokenizer(corpus.read_text().splitlines(), 300)
    torch.manual_seed(0)
    out = {}
    for name, cls, cfg_cls in [("llama", "LlamaForCausalLM", "LlamaConfig"),
                               ("qwen", "Qwen2ForCausalLM", "Qwen2Config")]:
        config = getattr(transformers, cfg_cls)(**SHAPE, tie_word_embeddings=False)
        getattr(transformers, cls)(config).save_pretrained(root / name)
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|endoftext|>",
            bos_token="<|endoftext|>").save_pretrained(root / name)
        out[name] = root / name
    return out


def _with(src: Path, dst: Path, file: str, field: str, text: str) -> Path:
    """A copy of ``src`` whose ``file`` has ``field`` (``a.b``: inside object ``a``) set to
    the JSON ``text`` exactly as written."""
    shutil.copytree(src, dst)
    data = json.loads((dst / file).read_text())
    inner = data
    *outer, last = field.split(".")
    for key in outer:
        inner = inner[key]
    inner[last] = "@VALUE@"
    (dst / file).write_text(json.dumps(data).replace('"@VALUE@"', text))
    return dst


def _validate(model: dict, tmp_path: Path) -> None:
    load_config(overrides={"model": model, "data": {"cache_dir": str(tmp_path / "cache")}})


def _refused(model: dict, tmp_path: Path, pattern: str) -> str:
    """The refusal of a configuration: a ConfigError of one line matching ``pattern``."""
    start = time.monotonic()
    with pytest.raises(ConfigError) as e:
        _validate(model, tmp_path)
    message = str(e.value)
    assert "\n" not in message
    assert re.search(pattern, message), message
    assert time.monotonic() - start < 30  # refused before any model is built layer by layer
    return message


def _count_refusal(option: str, file: Path, field: str, most: int = HF_COUNT_MAX) -> str:
    return (f"^{re.escape(option)}: {re.escape(shown_path(file))}: {field} is .*; expected an "
            f"integer from 1 to {most:,}, or null \\(not given\\)$")


COUNT_CASES = [
    ("llama", "init_from", "num_hidden_layers"),
    ("llama", "init_from", "hidden_size"),
    ("llama", "init_from", "vocab_size"),
    ("llama", "init_from", "num_attention_heads"),
    ("llama", "init_from", "num_key_value_heads"),
    ("llama", "init_from", "intermediate_size"),
    ("llama", "init_from", "max_position_embeddings"),
    ("llama", "init_from", "head_dim"),
    ("qwen", "init_from", "num_hidden_layers"),
    ("qwen", "init_from", "max_position_embeddings"),
    ("qwen", "init_from", "vocab_size"),
    ("qwen", "hf_config", "num_hidden_layers"),
    ("qwen", "hf_config", "max_position_embeddings"),
    ("qwen", "hf_config", "vocab_size"),
    ("qwen", "hf_config", "n_positions"),  # another spelling of the same field (GPT-2's)
]


@pytest.mark.parametrize("text", BAD_COUNTS)
@pytest.mark.parametrize(("arch", "option", "field"), COUNT_CASES,
                         ids=["-".join(c) for c in COUNT_CASES])
def test_a_count_that_is_no_count_is_refused_by_name(dirs, tmp_path, arch, option, field,
                                                     text):
    d = _with(dirs[arch], tmp_path / "m", "config.json", field, text)
    source = str(d) if option == "init_from" else str(d / "config.json")
    most = HF_LAYERS_MAX if field == "num_hidden_layers" else HF_COUNT_MAX
    _refused({option: source}, tmp_path,
             _count_refusal(f"model.{option}", d / "config.json", field, most))


@pytest.mark.parametrize("text", BAD_REALS)
@pytest.mark.parametrize("field", ["rms_norm_eps", "rope_theta", "initializer_range",
                                   "rope_parameters.rope_theta"])
def test_a_real_number_that_is_not_positive_and_finite_is_refused(dirs, tmp_path, field, text):
    d = _with(dirs["llama"], tmp_path / "m", "config.json", field, text)
    inner = f"{field.split('.')[0]}: " if "." in field else ""
    key = field.split(".")[-1]
    _refused({"init_from": str(d)}, tmp_path,
             f"^model.init_from: {re.escape(shown_path(d / 'config.json'))}: {inner}{key} is .*; "
             "expected a positive finite number, or null \\(not given\\)$")


@pytest.mark.parametrize("text", BAD_FLAGS)
@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_a_flag_that_is_not_true_or_false_is_refused(dirs, tmp_path, arch, text):
    d = _with(dirs[arch], tmp_path / "m", "config.json", "tie_word_embeddings", text)
    _refused({"init_from": str(d)}, tmp_path,
             f"^model.init_from: {re.escape(shown_path(d / 'config.json'))}: tie_word_embeddings "
             "is .*; expected true or false, or null \\(not given\\)$")


@pytest.mark.parametrize("text", ['"dynamic"', "[1]", "4"])
def test_rope_parameters_that_are_no_object_are_refused(dirs, tmp_path, text):
    d = _with(dirs["llama"], tmp_path / "m", "config.json", "rope_parameters", text)
    _refused({"init_from": str(d)}, tmp_path,
             f"^model.init_from: {re.escape(shown_path(d / 'config.json'))}: rope_parameters is "
             ".*; expected a JSON object")


def test_fractions_and_nulls_that_transformers_reads_are_kept(dirs, tmp_path):
    """What is accepted, on purpose: a real number may be any positive finite one (2.5 as
    an epsilon is odd, not malformed), ``null`` is the field not given where the class
    types it as optional (a Llama's ``head_dim`` is then the width by the heads, as
    transformers reads it; a null ``initializer_range`` is no default, LlamaConfig refuses
    it: test_a_null_the_config_class_requires_is_refused_by_name)."""
    from editrain.config.model import model_config

    d = _with(dirs["llama"], tmp_path / "m", "config.json", "rms_norm_eps", "2.5")
    data = json.loads((d / "config.json").read_text())
    data.update(head_dim=None)
    del data["initializer_range"]  # absent: the default
    (d / "config.json").write_text(json.dumps(data))
    mcfg = model_config(load_config(overrides={"model": {"init_from": str(d)}}))
    assert (mcfg.norm_eps, mcfg.init_std, mcfg.n_layers) == (2.5, 0.02, 2)


def test_a_config_of_10_30_layers_is_refused_not_built(dirs, tmp_path):
    """A ``model.hf_config`` has no weights to compare its layers with: 10**30 of them
    (without the ``layer_types`` list transformers checks) made validation build the model
    on the meta device layer by layer, and never finish."""
    config = tmp_path / "config.json"
    data = json.loads((dirs["qwen"] / "config.json").read_text())
    data.pop("layer_types", None)
    data["num_hidden_layers"] = 10**30
    config.write_text(json.dumps(data))
    _refused({"hf_config": str(config)}, tmp_path,
             _count_refusal("model.hf_config", config, "num_hidden_layers", HF_LAYERS_MAX))


@pytest.mark.parametrize("text", ["true", "2.5", "[4]", "-1", "1e400"])
def test_editrain_sample_refuses_a_count_that_is_no_count(dirs, tmp_path, text):
    from editrain.sample import load_for_sampling

    for arch in ("llama", "qwen"):
        d = _with(dirs[arch], tmp_path / arch, "config.json", "num_attention_heads", text)
        with pytest.raises(ValueError) as e:
            load_for_sampling(d)
        assert re.fullmatch(_count_refusal("sample", d / "config.json",
                                           "num_attention_heads"), str(e.value)), e.value


@pytest.mark.parametrize("text", ["true", "2.5", "5", "[4]", '["</s>"]', "-1", "1e400"])
@pytest.mark.parametrize("file", ["tokenizer_config.json", "special_tokens_map.json"])
def test_a_special_token_named_by_no_text_is_refused_not_skipped(dirs, tmp_path, file, text):
    """A tokenizer file names a special token by its text (or an object whose
    ``content`` is it): a number there was skipped, and the end of text silently became
    another token."""
    src = dirs["llama"]
    if file == "special_tokens_map.json":
        src = tmp_path / "src"
        shutil.copytree(dirs["llama"], src)
        (src / file).write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    d = _with(src, tmp_path / "m", file, "eos_token", text)
    _refused({"init_from": str(d)}, tmp_path,
             f"^data.tokenizer: {re.escape(shown_path(d / file))}: eos_token is .*; expected the "
             "token's text")


@pytest.mark.parametrize(("field", "value", "allowed"), [
    *[("n_layers", v, "an integer from 1 to 100,000") for v in (True, 2.5, "4", [4], 10**30)],
    ("n_heads", 10**30, "an integer from 1 to 2,147,483,647"),
    ("rope_theta", float("inf"), "a positive finite number"),
])
def test_a_checkpoint_markers_numbers_are_read_by_the_same_rule(field, value, allowed):
    """export and sample check a checkpoint's description of its model against its
    weights before building it: its numbers first, by the rule of a config.json."""
    from editrain.config.size import check_weights_match

    model = {"n_layers": 2, "dim": 8, "n_heads": 2, field: value}
    with pytest.raises(ConfigError, match=rf"^export: m/marker.json: {field} is .*; "
                                          rf"expected {allowed}"):
        check_weights_match(model, ["layers.0.w", "layers.1.w"], "m/marker.json",
                            option="export")


def test_every_message_about_a_model_directorys_config_names_model_init_from(
        dirs, tmp_path, monkeypatch):
    """A ``model.init_from`` directory of another architecture than Llama is read by the
    reader of ``model.hf_config`` files (:func:`editrain.models.hf.read_hf_config`), at
    validation and again in every worker: each of its messages named ``model.hf_config``,
    an option the user never set."""
    import torch

    from editrain.build import build_model
    from editrain.models import hf
    from editrain.models.hf import read_hf_config

    model = {"init_from": str(dirs["qwen"])}
    cfg = load_config(overrides={"model": model, "data": {"cache_dir": str(tmp_path / "c")}})
    config = dirs["qwen"] / "config.json"
    # a worker whose tokenizer has more ids than the model's embedding (vocab_size 320)
    with pytest.raises(ValueError, match=rf"^model.init_from: vocab_size 320 in "
                                         rf"{re.escape(shown_path(dirs['qwen']))} is smaller"):
        build_model(cfg, 1000, torch.device("cpu"))
    # the file as every caller reads it, with the option it came from
    bad = tmp_path / "bad"
    bad.mkdir()
    with pytest.raises(FileNotFoundError, match=r"^model.init_from: file not found: "):
        read_hf_config(bad, "model.init_from")
    for text, said in [("{not json", "not valid JSON"), ("{}", 'has no "model_type"'),
                       ('{"model_type": "qwen2", "vocab_size": 2.5}', "vocab_size is 2.5")]:
        (bad / "config.json").write_text(text)
        with pytest.raises(ValueError) as e:
            read_hf_config(bad, "model.init_from")
        assert str(e.value).startswith(f"model.init_from: \"{bad / 'config.json'}\""), e.value
        assert said in str(e.value)
    monkeypatch.setattr(hf, "transformers_available", lambda: False)
    _refused(model, tmp_path, r"^model.init_from needs the transformers package")
    assert config.is_file()


NULL_CASES = [
    *[("qwen", option, field) for option in ("init_from", "hf_config")
      for field in ("num_hidden_layers", "vocab_size", "hidden_size", "num_attention_heads",
                    "intermediate_size", "max_position_embeddings", "initializer_range",
                    "rms_norm_eps", "tie_word_embeddings")],
    *[("llama", "hf_config", field) for field in ("num_hidden_layers", "vocab_size",
                                                   "hidden_size", "max_position_embeddings")],
    ("llama", "init_from", "num_hidden_layers"),  # editrain's own Llama reads the file
    ("llama", "init_from", "vocab_size"),
    # ... and read these nulls as its own defaults, where transformers refuses them
    *[("llama", "init_from", field) for field in ("max_position_embeddings", "rms_norm_eps",
                                                  "initializer_range", "tie_word_embeddings",
                                                  "is_causal", "use_cache")],
]
NULL_ALLOWED = {"num_hidden_layers": f"an integer from 1 to {HF_LAYERS_MAX:,}",
                "initializer_range": "a positive finite number",
                "rms_norm_eps": "a positive finite number",
                "tie_word_embeddings": "true or false", "is_causal": "true or false",
                "use_cache": "true or false"}


@pytest.mark.parametrize(("arch", "option", "field"), NULL_CASES,
                         ids=["-".join(c) for c in NULL_CASES])
def test_a_null_the_config_class_requires_is_refused_by_name(dirs, tmp_path, arch, option,
                                                             field):
    """transformers' config classes pass a ``null`` field as None, which a field typed
    ``int`` (``float``, ``bool``) refuses: it is no default. It was refused only as the
    model was built, in transformers' words ("describes no causal LM transformers can
    build (Validation error for field 'num_hidden_layers':)"); now in one line naming
    the option, the file, the field and what is allowed, like every other bad number."""
    d = _with(dirs[arch], tmp_path / "m", "config.json", field, "null")
    source = str(d) if option == "init_from" else str(d / "config.json")
    allowed = NULL_ALLOWED.get(field, f"an integer from 1 to {HF_COUNT_MAX:,}")
    _refused({option: source}, tmp_path,
             f"^model.{option}: {re.escape(shown_path(d / 'config.json'))}: {field} is null, which "
             f"(Llama|Qwen2)Config does not take; expected {re.escape(allowed)}$")


@pytest.mark.parametrize(("arch", "field"), [("qwen", "sliding_window"),
                                             ("qwen", "rope_parameters"),
                                             ("qwen", "num_key_value_heads"),
                                             ("llama", "head_dim"),
                                             ("llama", "num_key_value_heads")])
def test_a_null_the_config_class_takes_is_kept(dirs, tmp_path, arch, field):
    """Fields transformers types as optional keep their ``null``: no sliding window, no
    RoPE parameters, as many key/value heads as query heads, the width by the heads."""
    d = _with(dirs[arch], tmp_path / "m", "config.json", field, "null")
    _validate({"hf_config": str(d / "config.json")}, tmp_path)


BASE_NULL_CASES = [(arch, option, field)
                   for arch, option in (("llama", "hf_config"), ("llama", "init_from"),
                                        ("qwen", "hf_config"))
                   for field in ("chunk_size_feed_forward", "is_encoder_decoder")]


@pytest.mark.parametrize(("arch", "option", "field"), BASE_NULL_CASES,
                         ids=["-".join(c) for c in BASE_NULL_CASES])
def test_a_null_in_a_field_pretrainedconfig_types_but_takes_is_kept(dirs, tmp_path, arch,
                                                                     option, field):
    """``PretrainedConfig`` types ``chunk_size_feed_forward`` as ``int`` and
    ``is_encoder_decoder`` as ``bool``, yet transformers 5.24 takes their ``null`` (every
    family builds with it): they were refused as LlamaConfig/Qwen2Config "does not take"
    them, by editrain's own Llama reader too. What a class requires is what it refuses."""
    d = _with(dirs[arch], tmp_path / "m", "config.json", field, "null")
    _validate({option: str(d) if option == "init_from" else str(d / "config.json")}, tmp_path)


def test_what_each_config_class_requires_is_read_from_the_class():
    """Which fields a null is refused in is each class's own typing, not a list of ours."""
    from editrain.models.hf import required_fields

    llama, qwen = required_fields("llama"), required_fields("qwen2")
    gpt2, gemma = required_fields("gpt2"), required_fields("gemma")
    assert llama[0] == "LlamaConfig" and "num_hidden_layers" in llama[1]
    assert "head_dim" not in llama[1] and "num_key_value_heads" not in llama[1]
    assert "sliding_window" not in qwen[1] and qwen[1]["max_position_embeddings"] == "an integer"
    assert gemma[1]["head_dim"] == "an integer"  # optional for a Llama, not for a Gemma
    assert gpt2[1]["n_embd"] == gpt2[1]["hidden_size"] == "an integer"  # attribute_map
    assert required_fields("no-such-model") is None


# ------------------------------------------------- nulls in keys the config class does not declare
FAMILY_SHAPES = {
    **{family: dict(SHAPE, **extra) for family, extra in [
        ("llama", {}), ("mistral", {}), ("mixtral", {}), ("qwen2", {}), ("qwen2_moe", {}),
        ("qwen3", {"head_dim": 8}), ("gemma", {"head_dim": 8}), ("gemma2", {"head_dim": 8}),
        ("phi", {}), ("phi3", {"pad_token_id": 0}), ("stablelm", {}), ("starcoder2", {}),
        ("olmo2", {}), ("granite", {})]},
    "gpt2": dict(vocab_size=320, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "gptj": dict(vocab_size=320, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4),
    "falcon": dict(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4),
    "bloom": dict(vocab_size=320, hidden_size=32, n_layer=2, n_head=4),
    "opt": dict(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64),
    "gpt_neox": dict(vocab_size=320, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64),
    "mpt": dict(vocab_size=320, d_model=32, n_layers=2, n_heads=4, max_seq_len=64),
}
"""A tiny model of each architecture family that trains in editrain (each layout of
:data:`editrain.units.BLOCK_PATHS`; the Llama-like ones by their most used variants)."""
# (family, key) whose null transformers 5.24's modeling code reads past its default: a
# plain ``getattr(config, key, default)`` (head_dim, is_causal) or a RoPE entry taken from
# the key when rope_parameters does not give it (``None ** x``); is_causal is read by
# every family's mask (masking_utils: ``not getattr(config, "is_causal", True)``).
NULL_BREAKS = [
    *[(family, "is_causal") for family in FAMILY_SHAPES],
    *[(family, "head_dim") for family in ("falcon", "granite", "olmo2", "phi", "phi3",
                                          "qwen2", "qwen2_moe")],
    *[(family, "rope_theta") for family in ("falcon", "gemma", "gemma2", "granite", "llama",
                                            "mistral", "mixtral", "olmo2", "phi", "phi3",
                                            "qwen2", "qwen2_moe", "qwen3", "stablelm",
                                            "starcoder2")],
    *[(family, "partial_rotary_factor") for family in ("phi", "phi3", "stablelm")],
    ("gpt_neox", "rotary_pct"), ("gpt_neox", "rotary_emb_base"),
]
# (family, key) whose null transformers reads as the default (``getattr(config, key, None)
# or ...``), or never reads: kept, like an absent key.
NULL_KEPT = [
    *[(family, "head_dim") for family in ("gpt2", "gptj", "bloom", "opt", "gpt_neox", "mpt",
                                          "starcoder2", "stablelm")],
    ("qwen2", "attention_bias"), ("qwen2", "mlp_bias"), ("qwen2", "pretraining_tp"),
    ("qwen2", "layer_norm_eps"), ("llama", "layer_norm_eps"), ("gpt2", "attention_bias"),
    ("llama", "partial_rotary_factor"), ("qwen2", "partial_rotary_factor"),
    ("gpt_neox", "rope_theta"), ("gpt2", "rope_theta"),
]
ROPE_ENTRY = {"rope_theta": "rope_theta", "partial_rotary_factor": "partial_rotary_factor",
              "rotary_emb_base": "rope_theta", "rotary_pct": "partial_rotary_factor"}
"""The keys a RoPE entry is taken from when ``rope_parameters`` does not give it."""
NULL_BREAKS_ALLOWED = {"is_causal": "true or false", "rope_theta": "a positive finite number",
                       "head_dim": f"an integer from 1 to {HF_COUNT_MAX:,}"}


def _family_config(tmp_path: Path, family: str, key: str, rope_parameters: bool) -> Path:
    """A ``config.json`` of ``family`` (written by transformers) with ``key`` null, with
    or without ``rope_parameters`` (a transformers 4 file has none: ``rope_theta`` and
    ``partial_rotary_factor`` are top-level keys there)."""
    config = transformers.AutoConfig.for_model(family, **FAMILY_SHAPES[family])
    data = json.loads(config.to_json_string())
    if not rope_parameters:
        data.pop("rope_parameters", None)
    data[key] = None
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("family", "key"), NULL_BREAKS, ids=["-".join(c) for c in NULL_BREAKS])
def test_a_null_transformers_reads_past_its_default_is_refused_by_name(tmp_path, family, key):
    """A key the config class does not declare is kept as an attribute, null included, and
    a null one defeats the default of the modeling code's ``getattr(config, key, default)``:
    a Qwen2's ``head_dim: null`` ended in transformers' own "unsupported operand type(s)
    for ** or pow(): 'NoneType' and 'float'", a null ``is_causal`` silently made every
    family's attention see the future. Now refused like a null the class refuses."""
    config = _family_config(tmp_path, family, key, rope_parameters=key not in ROPE_ENTRY)
    owner = type(transformers.AutoConfig.for_model(family)).__name__
    allowed = NULL_BREAKS_ALLOWED.get(key, "a number")
    _refused({"hf_config": str(config)}, tmp_path,
             f"^model.hf_config: {re.escape(shown_path(config))}: {key} is null, which {owner} does "
             f"not take; expected {re.escape(allowed)}$")


@pytest.mark.parametrize(("family", "key"), [
    *NULL_KEPT, *[(family, key) for family, key in NULL_BREAKS if key in ROPE_ENTRY]])
def test_a_null_transformers_reads_as_its_default_is_kept(tmp_path, family, key):
    """A null the modeling code reads as its default (``getattr(config, "head_dim", None)
    or ...``), never reads, or a RoPE key's null where ``rope_parameters`` gives the entry."""
    _validate({"hf_config": str(_family_config(tmp_path, family, key, rope_parameters=True))},
              tmp_path)


def test_the_nulls_refused_are_those_transformers_reads_past_its_default():
    """The table of :data:`editrain.models.hf_fields.NULL_READ_PAST_DEFAULT` is
    transformers' own behaviour: a tiny model of each family, built with the key null
    and without it, fails or computes other logits (a padded batch: is_causal) exactly
    where the table says."""
    import torch

    from editrain.models.hf_fields import nulls_read_past_default

    transformers.logging.set_verbosity_error()
    ids = torch.arange(8).unsqueeze(0)
    mask = torch.ones_like(ids)
    mask[0, 0] = 0

    def logits(family: str, **extra) -> torch.Tensor:
        config = transformers.AutoConfig.for_model(family, **FAMILY_SHAPES[family], **extra)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        return model(ids, attention_mask=mask).logits[0, 1:]

    keys = sorted({key for _, key in NULL_BREAKS + NULL_KEPT})
    for family in FAMILY_SHAPES:
        expected = logits(family)
        cls = transformers.CONFIG_MAPPING[family]
        declared = {field.name for field in dataclasses.fields(cls)} | set(cls.attribute_map)
        for key in set(keys) - declared:  # a declared key's null: the class's own typing
            try:
                breaks = not torch.allclose(logits(family, **{key: None}), expected)
            except Exception:  # noqa: BLE001 - transformers' own refusal, of any kind
                breaks = True
            refused = key in nulls_read_past_default({"model_type": family, key: None})
            assert refused == breaks, (family, key, breaks)


def test_editrains_llama_reads_a_rope_theta_null_as_transformers_does(dirs, tmp_path):
    """A Llama's RoPE base is ``rope_parameters.rope_theta``, else the top-level
    ``rope_theta`` (a transformers 4 file): a null one there is ``None ** x`` in
    transformers, not the default 10000 editrain's own reader took; kept where
    ``rope_parameters`` gives it."""
    from editrain.config.model import model_config

    d = _with(dirs["llama"], tmp_path / "kept", "config.json", "rope_theta", "null")
    mcfg = model_config(load_config(overrides={"model": {"init_from": str(d)}}))
    assert mcfg.rope_theta == 10000.0
    d = _with(dirs["llama"], tmp_path / "m", "config.json", "rope_parameters", "null")
    data = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**data, "rope_theta": None}))
    _refused({"init_from": str(d)}, tmp_path,
             f"^model.init_from: {re.escape(shown_path(d / 'config.json'))}: rope_theta is null, "
             "which LlamaConfig does not take; expected a positive finite number$")


def test_editrains_llama_refuses_the_nulls_llamaconfig_refuses():
    """editrain's own Llama reader works without transformers, from its own list of the
    fields LlamaConfig requires: the list is the class's."""
    from editrain.models.hf import required_fields
    from editrain.models.hf_llama import LLAMA_REQUIRED

    assert LLAMA_REQUIRED == required_fields("llama")[1]


# ------------------------------------------------- a value read from JSON is quoted as JSON
@pytest.mark.parametrize(("field", "text", "shown"), [
    ("vocab_size", "true", "vocab_size is true;"),
    ("num_hidden_layers", "false", "num_hidden_layers is false;"),
    ("hidden_size", '"32"', 'hidden_size is "32";'),
    ("hidden_size", "[32, null, true]", "hidden_size is [32, null, true];"),
    ("hidden_size", "1e400", "hidden_size is 1e+400;"),
    ("hidden_size", "-1e400", "hidden_size is -1e+400;"),
    ("rms_norm_eps", '{"a": null}', 'rms_norm_eps is {"a": null};'),
    ("tie_word_embeddings", '"false"', 'tie_word_embeddings is "false";'),
    ("hidden_act", '"gelu"', 'hidden_act is "gelu", not "silu"'),
    ("hidden_act", "null", 'hidden_act is null, not "silu"'),
    ("rope_parameters.rope_type", '"linear"', 'has rope_type "linear" (only'),
    ("rope_parameters.rope_type", "true", "has rope_type true (only"),
])
def test_a_value_read_from_a_json_file_is_quoted_as_json(dirs, tmp_path, field, text, shown):
    """A message quoted a config.json's value in Python's spelling (``vocab_size is
    True``, ``None``, ``'gelu'``, ``inf``): the file says ``true``, ``null``, ``"gelu"``,
    and a number JSON readers make infinite is one no JSON text spells but as such."""
    d = _with(dirs["llama"], tmp_path / "m", "config.json", field, text)
    message = _refused({"init_from": str(d)}, tmp_path, "")
    assert shown in message, message


@pytest.mark.parametrize("file", ["tokenizer_config.json", "special_tokens_map.json"])
def test_a_tokenizer_files_value_is_quoted_as_json(dirs, tmp_path, file):
    src = tmp_path / "src"
    shutil.copytree(dirs["llama"], src)
    (src / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    d = _with(src, tmp_path / "m", file, "eos_token", '{"content": true}')
    assert 'eos_token is {"content": true};' in _refused({"init_from": str(d)}, tmp_path, "")
    from editrain.models.hf_tokens import check_special_ids, tokenizer_special_ids

    d = _with(src, tmp_path / "n", "tokenizer_config.json", "eos_token", '"<nowhere>"')
    with pytest.raises(ValueError, match='the eos token "<nowhere>", which'):
        tokenizer_special_ids(d)
    with pytest.raises(ValueError, match=r"^\"config.json\": eos_token_id is \[true\], not a token"):
        check_special_ids({"eos_token_id": [True]}, 320, "config.json")


def test_a_llama3_rope_scaling_read_from_a_json_file_is_quoted_as_json(dirs, tmp_path):
    """Llama 3's RoPE scaling entries of a config.json are read by the strict reader too
    (``1e400`` was taken as an infinite factor, ``true`` was quoted ``True``)."""
    scaling = {"rope_type": "llama3", "rope_theta": 500000.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    for text, shown in (("true", "factor is true"), ("1e400", "factor is 1e+400")):
        d = _with(dirs["llama"], tmp_path / text, "config.json", "rope_parameters", json.dumps(
            {**scaling, "factor": "@"}).replace('"@"', text))
        _refused({"init_from": str(d)}, tmp_path,
                 f"^model.init_from: {re.escape(shown_path(d / 'config.json'))}: rope_parameters: "
                 f"{re.escape(shown)}; expected a positive finite number, or null "
                 "\\(not given\\)$")


def test_quote_spells_a_value_as_the_json_text_that_reads_back_as_it():
    from editrain.safe_io import quote

    for value, text in [(True, "true"), (False, "false"), (None, "null"), (2.5, "2.5"),
                        (10**30, "1" + "0" * 30), (1e-05, "1e-05"), ("4", '"4"'),
                        ('a "b"\n', '"a \\"b\\"\\n"'), ([1, None, "x"], '[1, null, "x"]'),
                        ({"k": False}, '{"k": false}'), (float("inf"), "1e+400"),
                        (float("-inf"), "-1e+400"), (float("nan"), "NaN")]:
        assert quote(value) == text, value
        if value == value:  # NaN: no JSON text reads back as it (Python's reader takes NaN)
            assert json.loads(quote(value)) == value
    assert quote("x" * 100) == '"' + "x" * 60 + '"... (100 characters)'
    assert quote(list(range(20))) == "a list of 20 entries"
    assert quote([list(range(20))]) == "[a list of 20 entries]"
