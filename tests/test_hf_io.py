"""Hugging Face models in and out (issue 49): ``model.init_from``, ``editrain export``,
``editrain sample``, a model directory as ``data.tokenizer``.

Tiny models saved with ``save_pretrained`` (random weights, safetensors, also sharded): a
``LlamaForCausalLM`` (editrain's own Llama through the name map) and a
``Qwen2ForCausalLM`` (another architecture, through the Hugging Face adapter under its own
names; it has q/k/v biases, which the Llama has not). Logits are compared with
transformers' forward to 1e-5 relative (plus 1e-6 absolute for logits near zero): both
models compute the same float32 function, but not in the same order (transformers' RMSNorm
multiplies after casting back, its attention may pick another SDPA kernel), so they agree
to a few ulps, not bitwise. Weights, which are only copied, are compared bitwise. Both
architectures load on 2 x 2 (FSDP), 2 x 1 x 2 (tp) and 2 pipeline stages (the last stage's
logits, each stage's output handed on to the next), 4 ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

from editrain.config import ConfigError, load_config
from editrain.models import Llama
from editrain.models.hf_dir import hf_parameters, inspect_weights, read_config
from editrain.models.hf_llama import (
    from_hf_name,
    llama_config_from_hf,
    llama_config_to_hf,
    to_hf_name,
)
from editrain.paths import shown
from editrain.spawn import run_ranks
from tests.cli import run_cli
from tests.hf_io_workers import MESHES, load_worker
from tests.test_examples import write_corpus

transformers = pytest.importorskip(
    "transformers", reason="the Hugging Face tests need the hf extra (pip install -e '.[hf]')")

SHAPE = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
RTOL, ATOL = 1e-5, 1e-6
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
EOT = "<|endoftext|>"


def _save_tokenizer(out: Path, corpus: Path) -> None:
    from editrain.data.tokenizer import train_bpe_tokenizer

    tok = train_bpe_tokenizer(corpus.read_text().splitlines(), 300)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT,
                                                bos_token=EOT)
    fast.save_pretrained(out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    """The model directories every test reads (never written to by a test)."""
    root = tmp_path_factory.mktemp("hf")
    corpus = write_corpus(root / "corpus.txt", lines=600)
    torch.manual_seed(0)
    out = {"root": root, "corpus": corpus}
    for name, cls, cfg_cls, extra, shard in [
        ("llama", "LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": False}, None),
        ("llama_tied", "LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": True}, None),
        ("llama_sharded", "LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": False},
         "20KB"),
        ("qwen", "Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": False}, "20KB"),
        # the head is the embedding, as in Qwen2.5-0.5B or Gemma: one tensor in the files
        ("qwen_tied", "Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": True}, None),
        # Llama 3's RoPE scaling, its band edges at 4 and 16 positions: every frequency of
        # the 8-wide heads is kept, blended or divided within the tests' 16 positions
        ("llama3_rope", "LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": False,
         "rope_parameters": LLAMA3_ROPE}, None),
    ]:
        config = getattr(transformers, cfg_cls)(**SHAPE, **extra)
        model = getattr(transformers, cls)(config)
        with torch.no_grad():  # zero biases would hide a bias that is not loaded
            for pname, p in model.named_parameters():
                if pname.endswith(".bias"):
                    p.normal_(0.0, 0.02)
        kw = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(root / name, **kw)
        out[name] = root / name
    for name in ("llama", "qwen", "qwen_tied"):
        _save_tokenizer(out[name], corpus)
    assert (out["llama_sharded"] / "model.safetensors.index.json").is_file()
    return out


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        return model(input_ids=tokens).logits


def tokens(n: int = 2, t: int = 16) -> torch.Tensor:
    return torch.randint(0, 300, (n, t), generator=torch.Generator().manual_seed(1))


def file_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# ---------------------------------------------------------------------------- the map
def test_name_map_is_a_bijection_over_the_llamas_parameters(dirs):
    cfg = llama_config_from_hf(read_config(dirs["llama"]))
    names = [n for n, _ in Llama(cfg).named_parameters()]
    hf = [to_hf_name(n) for n in names]
    assert [from_hf_name(n) for n in hf] == names
    saved = file_tensors(dirs["llama"])
    assert sorted(hf) == sorted(saved)  # exactly LlamaForCausalLM's names
    assert to_hf_name("layers.1.attention.wq.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert to_hf_name("layers.0.feed_forward.w1.weight") == "model.layers.0.mlp.gate_proj.weight"
    with pytest.raises(KeyError):
        from_hf_name("model.layers.0.self_attn.q_proj.bias")


def test_config_map_both_ways(dirs):
    data = read_config(dirs["llama"])
    cfg = llama_config_from_hf(data)
    assert (cfg.vocab_size, cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
            cfg.ffn_hidden, cfg.max_seq_len, cfg.tie_embeddings) == (
        320, 32, 2, 4, 2, 64, 64, False)
    assert cfg.norm_eps == data["rms_norm_eps"]
    assert cfg.rope_theta == data["rope_parameters"]["rope_theta"]
    back = llama_config_to_hf(cfg)
    assert llama_config_from_hf(back) == cfg
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings"):
        assert back[key] == data[key], key
    with pytest.raises(ValueError, match="hidden_act"):
        llama_config_from_hf({**data, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match='rope_type "linear"'):
        llama_config_from_hf({**data, "rope_parameters": {"rope_type": "linear",
                                                          "factor": 2.0}})


# ---------------------------------------------------------------------------- one process
@pytest.mark.parametrize("name", ["llama", "llama_tied", "llama_sharded", "llama3_rope"])
def test_llama_directory_gives_transformers_logits(dirs, name):
    from editrain.hf_checkpoint import load_hf_weights

    model = Llama(llama_config_from_hf(read_config(dirs[name])))
    assert load_hf_weights(model, dirs[name]) == len(list(model.parameters()))
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_logits(dirs[name], x), rtol=RTOL, atol=ATOL)
    saved = file_tensors(dirs[name])
    for hf_name, p in hf_parameters(model).items():
        assert torch.equal(p, saved[hf_name]), hf_name


def test_llama3_rope_scaling_is_computed_not_dropped(dirs):
    """Llama 3's scaled RoPE: the config maps both ways (an export writes what transformers
    4 and 5 read), and the plain RoPE on the same weights is far from transformers' logits
    (the scaling matters at these positions: the test above is not vacuous)."""
    import dataclasses

    from editrain.hf_checkpoint import load_hf_weights

    cfg = llama_config_from_hf(read_config(dirs["llama3_rope"]))
    assert cfg.rope_scaling == {k: v for k, v in LLAMA3_ROPE.items()
                                if k not in ("rope_type", "rope_theta")}
    data = llama_config_to_hf(cfg)
    assert llama_config_from_hf(data) == cfg
    assert data["rope_parameters"] == LLAMA3_ROPE
    assert data["rope_scaling"]["rope_type"] == "llama3"
    read = transformers.LlamaConfig(**data)
    params = getattr(read, "rope_parameters", None) or read.rope_scaling
    assert params["rope_type"] == "llama3" and params["factor"] == 8.0
    plain = Llama(dataclasses.replace(cfg, rope_scaling=None))
    load_hf_weights(plain, dirs["llama3_rope"])
    x = tokens()
    with torch.no_grad():
        assert (plain(x) - hf_logits(dirs["llama3_rope"], x)).abs().max() > 1e-4
    with pytest.raises(ValueError, match=r"rope_parameters \(llama3\): rope_scaling.high_freq_"
                                         r"factor must exceed low_freq_factor"):
        llama_config_from_hf({**read_config(dirs["llama3_rope"]),
                              "rope_parameters": {**LLAMA3_ROPE, "high_freq_factor": 1.0}})
    with pytest.raises(ValueError, match=r'rope_type "yarn" \(only the default RoPE and '
                                         r"llama3's"):
        llama_config_from_hf({**read_config(dirs["llama3_rope"]),
                              "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})


def test_other_architecture_through_the_adapter(dirs):
    from editrain.hf_checkpoint import load_hf_weights
    from editrain.models.hf import HFCausalLM

    model = HFCausalLM.from_config_file(dirs["qwen"], seed=5)
    load_hf_weights(model, dirs["qwen"])
    assert "model.layers.0.self_attn.q_proj.bias" in hf_parameters(model)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf_logits(dirs["qwen"], x), rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------- sharded
@pytest.fixture(scope="module")
def loaded(dirs) -> list[list[dict]]:
    """Per rank, per case of :data:`MESHES`: what the rank loaded and computed."""
    names = {name for name, *_ in MESHES}
    return run_ranks(load_worker, 4, {n: str(dirs[n]) for n in names}, tokens())


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", range(len(MESHES)),
                         ids=[f"{n}-{s}x{t}tp-{p}pp" for n, s, t, p in MESHES])
def test_sharded_model_loads_the_directory(dirs, loaded, case):
    name, _, _, pp = MESHES[case]
    x = tokens()
    outs = [rank[case] for rank in loaded]
    saved = file_tensors(dirs[name])
    expected = hf_logits(dirs[name], x)
    seen: set[str] = set()
    for out in outs:
        for hf_name, w in out["weights"].items():
            assert torch.equal(w, saved[hf_name]), hf_name
            seen.add(hf_name)
        if "logits" in out:
            torch.testing.assert_close(out["logits"], expected, rtol=RTOL, atol=ATOL)
    # every rank's logits without stages; with them, the last stage's of both replicas
    assert sum("logits" in out for out in outs) == (4 if pp == 1 else 2)
    assert seen == set(saved)  # every tensor of the directory landed somewhere
    # every rank holds a part only: a replica's ranks together hold one model
    total = sum(t.numel() for t in saved.values())
    assert all(out["local"] < total for out in outs)


# ---------------------------------------------------------------------------- refused
def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _refused(tmp: Path, init: Path, match: str, **data) -> None:
    with pytest.raises(ConfigError, match=match) as e:
        load_config(overrides={"model": {"init_from": str(init)},
                               "data": {"cache_dir": str(tmp / "cache"), **data}})
    assert "\n" not in str(e.value)


def big_tokenizer(tmp: Path) -> Path:
    """A tokenizer.json of 401 ids (more than the test models' 320 rows)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(400)} | {"<|endoftext|>": 400}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp / "big_tokenizer.json"))
    return tmp / "big_tokenizer.json"


def test_bad_directories_are_refused_in_one_line(dirs, tmp_path):
    ok = load_config(overrides={"model": {"init_from": str(dirs["llama"])}})
    assert ok.model.init_from == str(dirs["llama"])
    _refused(tmp_path, tmp_path / "missing", "model.init_from: .*missing\" is not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    _refused(tmp_path, empty, "model.init_from: .*has no config.json")
    (empty / "config.json").write_text(json.dumps(read_config(dirs["llama"])))
    _refused(tmp_path, empty, "model.init_from: .*has no weights")
    # a pickle is never loaded, whatever it holds
    (empty / "pytorch_model.bin").write_bytes(b"not even read")
    _refused(tmp_path, empty, "pytorch_model.bin\", a pickle-based weight file .* never loads")
    # a weight file that is a link out of the directory
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (linked / f).write_bytes((dirs["llama"] / f).read_bytes())
    (linked / "model.safetensors").symlink_to(dirs["llama"] / "model.safetensors")
    _refused(tmp_path, linked, "model.safetensors\" is a link to .*, outside")
    # truncated, and a header length beyond the file
    cut = _copy(dirs["llama"], tmp_path / "cut")
    blob = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(blob[:-100])
    _refused(tmp_path, cut, "model.init_from: .*model.safetensors\" is truncated or corrupt "
             r"\(tensor")
    (cut / "model.safetensors").write_bytes(struct.pack("<Q", 2**40) + blob[8:])
    _refused(tmp_path, cut, "truncated or corrupt \\(header of 1099511627776 bytes")
    (cut / "model.safetensors").write_bytes(blob[:5])
    _refused(tmp_path, cut, "is truncated \\(5 bytes")
    # a shard the index names is missing
    shards = _copy(dirs["llama_sharded"], tmp_path / "shards")
    victim = sorted(shards.glob("model-*.safetensors"))[0]
    victim.unlink()
    _refused(tmp_path, shards, f'names the shard "{victim.name}", which is not a '
             "safetensors file")
    # shape: config.json says another width than the weights have
    wide = _copy(dirs["llama"], tmp_path / "wide")
    data = read_config(wide)
    (wide / "config.json").write_text(json.dumps({**data, "intermediate_size": 96}))
    _refused(tmp_path, wide, 'tensor "model.layers.0.mlp.gate_proj.weight" .* has shape '
             r"\[64, 32\], the model of its config.json needs \[96, 32\]")
    # vocabulary: a BPE of 8192 ids does not fit an embedding of 320 rows
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).write_bytes((dirs["llama"] / f).read_bytes())
    _refused(tmp_path, bare, "model.init_from: .*bare\" has no tokenizer.json, and a new "
             "tokenizer's ids would mean nothing to its weights: name the model's tokenizer "
             "with data.tokenizer")
    # a tokenizer of more ids than the embedding has rows
    _refused(tmp_path, bare, "data.tokenizer: the tokenizer has 401 ids, more than the "
             "embedding .* has rows \\(320\\)", tokenizer=str(big_tokenizer(tmp_path)))
    # an architecture transformers does not know
    odd = _copy(dirs["qwen"], tmp_path / "odd")
    (odd / "config.json").write_text(json.dumps({**read_config(odd), "model_type": "nosuch"}))
    _refused(tmp_path, odd, "model.init_from: .*describes no causal LM")
    # a causal LM whose layers are not transformer blocks where editrain looks (Mamba's
    # backbone.layers): it was "no causal LM transformers can build", with the advice of the
    # Python API (blocks=...)
    mamba = tmp_path / "mamba"
    transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=320, hidden_size=32, num_hidden_layers=2, state_size=4)).save_pretrained(mamba)
    _refused(tmp_path, mamba, f"^model.init_from: {shown(mamba)} describes a MambaForCausalLM, whose "
             "layers are in none of the places editrain looks for a causal LM's transformer "
             "blocks")
    from editrain.sample import load_for_sampling  # and so is editrain sample DIR of it

    with pytest.raises(ValueError, match=re.escape(f"sample: {shown(mamba)} describes a "
                                                   "MambaForCausalLM, whose layers are in none")):
        load_for_sampling(mamba)
    with pytest.raises(ConfigError, match="remove model.dim"):
        load_config(overrides={"model": {"init_from": str(dirs["llama"]), "dim": 64}})


def test_only_the_files_the_index_names_are_weights(dirs, tmp_path, monkeypatch):
    """As transformers reads a directory: a ``*.safetensors`` file the index does not name
    (a Mistral repository's ``consolidated.safetensors``, a stale shard), or one beside
    ``model.safetensors`` without an index, is not read, though DCP's reader reads every
    such file of a directory; ``./`` before a shard's name is the same shard. A stale file
    holding the model's own names with other values proves it is not read."""
    import shutil
    import tempfile

    from safetensors.torch import save_file

    from editrain.hf_checkpoint import load_hf_weights

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the view is made
    x = tokens()
    stale = {k: torch.zeros_like(t) for k, t in file_tensors(dirs["llama"]).items()}
    shards = _copy(dirs["llama_sharded"], tmp_path / "shards")
    save_file(stale, shards / "consolidated.safetensors")
    single = _copy(dirs["llama"], tmp_path / "single")
    save_file(stale, single / "model-old.safetensors")
    both = _copy(dirs["llama_sharded"], tmp_path / "both")  # model.safetensors wins
    shutil.copy(dirs["llama"] / "model.safetensors", both / "model.safetensors")
    dotted = _copy(dirs["llama_sharded"], tmp_path / "dotted")
    index = json.loads((dotted / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: f"./{v}" for k, v in index["weight_map"].items()}
    (dotted / "model.safetensors.index.json").write_text(json.dumps(index))
    for d, source in ((shards, "llama_sharded"), (single, "llama"), (dotted, "llama_sharded"),
                      (both, "llama")):
        model = Llama(llama_config_from_hf(read_config(d)))
        load_hf_weights(model, d)
        with torch.no_grad():
            got = model(x)
            torch.testing.assert_close(got, hf_logits(dirs[source], x), rtol=RTOL, atol=ATOL)
            # what transformers reads of the directory as it is
            torch.testing.assert_close(got, hf_logits(d, x), rtol=RTOL, atol=ATOL)
    assert not list(tmp_path.glob("editrain-weights-*"))  # the view is gone
    # an index that disagrees with its shards is refused with what it says and what is
    names = json.loads((dirs["llama_sharded"] / "model.safetensors.index.json").read_text())
    files = sorted(set(names["weight_map"].values()))
    moved = next(k for k, v in names["weight_map"].items() if v == files[-1])
    for case, weight_map, match in (
            ("elsewhere", {**names["weight_map"], moved: files[0]},
             f"\"{files[-1]}\" holds \"{moved}\", which model.safetensors.index.json places in "
             f"\"{files[0]}\""),
            ("unlisted", {k: v for k, v in names["weight_map"].items() if k != moved},
             f"\"{files[-1]}\" holds \"{moved}\", which model.safetensors.index.json does not list")):
        bad = _copy(dirs["llama_sharded"], tmp_path / case)
        (bad / "model.safetensors.index.json").write_text(
            json.dumps({**names, "weight_map": weight_map}))
        _refused(tmp_path, bad, "model.init_from: " + match)
    # a listed shard that lacks a tensor the index places there
    lost = _copy(dirs["llama_sharded"], tmp_path / "lost")
    rest = {k: t for k, t in _file(lost / files[-1]).items() if k != moved}
    save_file(rest, lost / files[-1], metadata={"format": "pt"})
    _refused(tmp_path, lost, f"model.init_from: model.safetensors.index.json places "
             f'"{moved}" in "{files[-1]}", which does not hold it')


def test_the_hubs_layout_of_a_converted_architecture_is_refused_with_the_way_out(
        dirs, tmp_path):
    """GPT-NeoX's files name its head ``embed_out`` (``save_pretrained`` writes the hub's
    layout; transformers renames it to ``lm_head`` as it loads): refused in one line that
    says so and how to convert, and the conversion it names trains."""
    import shutil

    from safetensors.torch import save_model

    config = transformers.GPTNeoXConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=64, tie_word_embeddings=False)
    hub = tmp_path / "neox"
    transformers.GPTNeoXForCausalLM(config).save_pretrained(hub)
    assert "embed_out.weight" in file_tensors(hub)
    _refused(tmp_path, hub, r'has no tensor "lm_head.weight", .* but 1 it has no parameter '
             r"for \(\"embed_out.weight\", ...\): the hub's layout .* safetensors.torch.save_model")
    new = tmp_path / "converted"
    new.mkdir()
    save_model(transformers.AutoModelForCausalLM.from_pretrained(hub), new / "model.safetensors")
    shutil.copy(hub / "config.json", new / "config.json")
    _save_tokenizer(new, dirs["corpus"])
    cfg = load_config(overrides={"model": {"init_from": str(new)},
                                 "data": {"cache_dir": str(tmp_path / "cache")}})
    assert cfg.model.init_from == str(new)


def _file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path)


REVISION = "0123abcd" * 5
"""The commit of the made-up hub cache's snapshot (40 hex digits, as the hub's)."""


def _hub_snapshot(src: Path, hub: Path, tokenizer: Path | None = None) -> Path:
    """``src`` laid out as the Hugging Face hub cache keeps a model: every file once in
    ``models--ORG--NAME/blobs/`` and linked from ``snapshots/REVISION/``."""
    import hashlib

    repo = hub / "models--me--tiny"
    snap, blobs = repo / "snapshots" / REVISION, repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    files = {f.name: f for f in sorted(tokenizer.glob("tokenizer*.json"))} if tokenizer else {}
    files.update((f.name, f) for f in sorted(src.iterdir()))
    for f in files.values():
        blob = blobs / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / blob.name)
    return snap


def test_a_snapshot_of_the_hub_cache_is_a_model_directory(dirs, tmp_path):
    """A model in the hub cache (HF_HOME) is used where it is: its snapshot's links into
    the repository's blobs/ are the cache's layout, not a link out of the directory. Any
    other link out is still refused."""
    from editrain.sample import _hf_dir_model, load_for_sampling

    for name in ("llama", "llama_sharded"):
        snap = _hub_snapshot(dirs[name], tmp_path / name, tokenizer=dirs["llama"])
        cfg = load_config(overrides={"model": {"init_from": str(snap)}})
        assert cfg.model.init_from == str(snap)
        x = tokens()
        with torch.no_grad():
            ours = load_for_sampling(snap).model(x)
            theirs = _hf_dir_model(dirs[name])[0](x)  # the directory itself, no tokenizer
        assert torch.equal(ours, theirs)
    # a file linked from outside the repository's blobs/ is refused, as anywhere
    victim = sorted(snap.glob("model-*.safetensors"))[0]
    victim.unlink()
    victim.symlink_to(dirs["llama_sharded"] / victim.name)
    _refused(tmp_path, snap, f"{victim.name}\" is a link to .*, outside .*{REVISION}\" \\(and not "
             "into its Hugging Face cache's blobs/\\)")
    # the same links without the cache's layout (no models--ORG--NAME above snapshots/)
    plain = tmp_path / "plain"
    shutil.copytree(tmp_path / "llama" / "models--me--tiny", plain, symlinks=True)
    _refused(tmp_path, plain / "snapshots" / REVISION, "model.safetensors\" is a link to .*"
             "outside")


def test_hf_ids_name_models_of_the_hub_cache_where_the_user_keeps_it(dirs, tmp_path):
    """model.init_from, data.tokenizer and sample take hf:ORG/NAME[@REVISION]: the snapshot
    of the hub cache that HF_HUB_CACHE (or HF_HOME) names, as huggingface_hub finds it, never
    downloaded; a model the cache does not hold is one line saying where the cache is."""
    hub = tmp_path / "hub"
    snap = _hub_snapshot(dirs["llama"], hub)
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    cache = tmp_path / "cache"
    out = run_cli(["data", "--model.init_from", "hf:me/tiny", "--data.path",
                   str(dirs["corpus"]), "--data.cache_dir", str(cache), "--json"], env=env)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["vocab_size"] == 300  # the snapshot's tokenizer, not a BPE of 8192
    sample = ["sample", "--prompt", "def", "--max-new-tokens", "4"]  # the id as its path
    by_id = run_cli([*sample[:1], f"hf:me/tiny@{REVISION}", *sample[1:]], env=env)
    by_path = run_cli([*sample[:1], str(snap), *sample[1:]], env=env)
    assert by_id.returncode == 0 and by_id.stdout == by_path.stdout, by_id.stderr
    for spec, said in (("hf:me/other", "me/other is not in the Hugging Face cache "
                        f"({shown(hub)}, set by HF_HOME or HF_HUB_CACHE)"),
                       ("hf:me/tiny@v2", "me/tiny@v2 is not in the Hugging Face cache"),
                       ("hf:not a repo", '"hf:not a repo" is not hf:ORG/NAME[@REVISION]')):
        out = run_cli(["data", "--model.init_from", spec, "--data.path", str(dirs["corpus"]),
                       "--data.cache_dir", str(cache)], env=env)
        assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
        assert out.stderr.startswith(f"editrain: error: model.init_from: {said}"), out.stderr


def test_hf_config_takes_a_hub_id_as_its_config_json(dirs, tmp_path, monkeypatch):
    """model.hf_config (a file) of hf:ORG/NAME is that snapshot's config.json."""
    import huggingface_hub

    snap = _hub_snapshot(dirs["qwen"], tmp_path / "hub")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = load_config(overrides={"model": {"hf_config": "hf:me/tiny"},
                                 "data": {"vocab_size": 300}})
    assert cfg.model.hf_config == str(snap / "config.json")
    with pytest.raises(ConfigError, match=r"^model.hf_config: me/nothing is not in the "
                                          r"Hugging Face cache"):
        load_config(overrides={"model": {"hf_config": "hf:me/nothing"}})


def test_the_command_refuses_before_launch(dirs, tmp_path, capsys):
    """editrain train with a pickle-only directory: exit 2, one line, no run directory."""
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(read_config(dirs["llama"])))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04never unpickled")
    run = tmp_path / "run"
    code, _, err = _main(capsys, "train", "--model.init_from", pickled, "--run-dir", run)
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("editrain: error: model.init_from: ") and "pickle" in err
    assert not run.exists()


def test_the_weights_are_inspected_without_reading_them(dirs):
    weights = inspect_weights(dirs["llama_sharded"])
    assert len(weights.files) > 1 and len(weights.tensors) == 21
    assert weights.tensors["model.embed_tokens.weight"].shape == (320, 32)


# ---------------------------------------------------------------------------- tokenizer
def test_model_directory_as_tokenizer_takes_its_end_of_text(dirs, tmp_path):
    """The separator between documents is the token tokenizer_config.json names as EOS."""
    import numpy as np

    from editrain.corpus import prepare_data

    tok_dir = _copy(dirs["llama"], tmp_path / "tok")
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(tok_dir)
    fast.add_special_tokens({"eos_token": "<eot>"})
    fast.save_pretrained(tok_dir)
    eot = fast.convert_tokens_to_ids("<eot>")
    cfg = load_config(overrides={"data": {
        "path": str(dirs["corpus"]), "tokenizer": str(tok_dir),
        "cache_dir": str(tmp_path / "cache"), "val_tokens": 256}})
    data = prepare_data(cfg)
    train = np.asarray(data.train)
    assert data.vocab_size == eot + 1
    # one document (a text file): one separator, the named one, although <|endoftext|>,
    # which editrain would pick by itself, is in the vocabulary too
    assert (train == eot).sum() == 1 and train[-1] == eot
    assert fast.convert_tokens_to_ids(EOT) is not None
    assert (train == fast.convert_tokens_to_ids(EOT)).sum() == 0


# ---------------------------------------------------------------------------- train, export
PROMPT = "Once upon a time"


def readme_commands(paths: dict[str, Path]) -> list[list[str]]:
    """The ``editrain`` commands of README's "From a pretrained model to a trained one",
    each as its arguments, with README's paths replaced by ``paths``."""
    import shlex

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text.split("## From a pretrained model to a trained one", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    commands = []
    for line in block.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("editrain "):
            for old, new in paths.items():
                line = line.replace(old, str(new))
            commands.append(shlex.split(line))
    assert [c[1] for c in commands] == ["train", "export", "sample"], commands
    return commands


def _train(dirs: dict, run: Path | None, init: Path | None, *extra: str, steps: int = 4
           ) -> None:
    """A tiny ``editrain train`` (run and init None: ``extra`` names them)."""
    named = [] if run is None else ["--model.init_from", str(init), "--run-dir", str(run)]
    cmd = ["train", *named, "--nproc", "4", "--shard-size", "2", "--data.path",
           str(dirs["corpus"]), "--checkpoint.export_final", "true", *extra,
           # the test size, after README's options (the last one given wins)
           "--steps", str(steps), "--quiet", "--data.cache_dir", str(dirs["root"] / "cache"),
           "--data.val_tokens", "256", "--train.seq_len", "32", "--train.batch_size", "4",
           "--train.eval_tokens", "256", "--train.final_eval_tokens", "256",
           "--train.warmup_steps", "1", "--sync.local_sgd_sync_interval", "2"]
    proc = run_cli(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def trained(dirs) -> dict[str, Path]:
    """Runs of EDiT on 2 replicas x 2 shards, exported at the end: from the Llama directory;
    and from each directory at a learning rate too small to change a float32 weight, whose
    export must be the directory's weights bitwise (the round trip through the sharded
    load, the anchors and the checkpoint)."""
    root = dirs["root"]
    runs: dict = {"llama": root / "run_llama", "still": root / "run_still",
                  "still_qwen": root / "run_still_qwen",
                  "still_qwen_tied": root / "run_still_qwen_tied"}
    # README's commands, on the tiny directory: train (at test size), export, sample
    train, export, sample = readme_commands({
        "./my-llama": dirs["llama"], "./my_corpus.txt": dirs["corpus"],
        "runs/ft-hf": runs["llama"] / "export", "runs/ft": runs["llama"]})
    _train(dirs, None, None, *train[2:], "--checkpoint.export_final", "false")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for cmd in (export, sample):
        proc = run_cli(cmd[1:], env=env, timeout=200)
        assert proc.returncode == 0, proc.stderr[-3000:]
    runs["readme_sample"] = proc.stdout
    for still, init in (("still", "llama"), ("still_qwen", "qwen"),
                        ("still_qwen_tied", "qwen_tied")):
        _train(dirs, runs[still], dirs[init], "--train.lr", "1e-30",
               "--train.weight_decay", "0")
    return runs


def _global_logits(run: Path, x: torch.Tensor) -> torch.Tensor:
    from editrain.sample import load_for_sampling

    with torch.no_grad():
        return load_for_sampling(run).model(x)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["llama", "still_qwen", "still_qwen_tied"])
def test_trained_export_loads_in_transformers_with_equal_logits(trained, dirs, name):
    out = trained[name] / "export"
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert tok.eos_token == EOT
    # the special-token ids of the directory it started from (the Llama's config says 1 and
    # 2, its tokenizer 0; Qwen's config names none)
    assert _special_ids(out) == _special_ids(dirs[name.replace("still_", "")])
    x = tokens()
    with torch.no_grad():
        theirs = model(input_ids=x).logits
    torch.testing.assert_close(_global_logits(trained[name], x), theirs, rtol=RTOL, atol=ATOL)
    saved, exported = file_tensors(dirs[name.replace("still_", "")]), file_tensors(out)
    assert set(saved) == set(exported)
    # a tied head is written once, as save_pretrained writes it, and tied again on loading
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == name.endswith("_tied") == ("lm_head.weight" not in exported)
    if name == "llama":  # it trained: the exported weights moved away from the directory's
        assert not torch.equal(saved["model.norm.weight"], exported["model.norm.weight"])
    readme = (out / "README.md").read_text()
    assert "method: edit" in readme and "step: 4" in readme and "anchors" in readme
    # how the model generates (its end-of-text ids) comes along from the directory
    generation = dirs[name.replace("still_", "")] / "generation_config.json"
    assert (out / "generation_config.json").read_bytes() == generation.read_bytes()
    assert transformers.GenerationConfig.from_pretrained(out).to_dict() == \
        transformers.GenerationConfig.from_pretrained(generation.parent).to_dict()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["llama", "qwen", "qwen_tied"])
def test_round_trip_is_bitwise(trained, dirs, name, tmp_path):
    """HF -> editrain's Llama (or the adapter), sharded 2 x 2 through DCP -> anchors in a
    checkpoint -> HF: the same bytes; so is one replica's export (``--replica 1``). A tied
    head (one tensor in the directory, two names in the model) was refused by the global
    model's export ('no global copy of "hf.lm_head.weight"')."""
    from editrain.hf_checkpoint import export_checkpoint

    run = trained["still" if name == "llama" else f"still_{name}"]
    export_checkpoint(run, tmp_path / "replica1", replica=1)
    saved = file_tensors(dirs[name])
    for out in (run / "export", tmp_path / "replica1"):
        exported = file_tensors(out)
        assert set(saved) == set(exported), out
        for key, t in saved.items():
            assert torch.equal(t, exported[key]), (out, key)
    data, back = read_config(dirs[name]), read_config(out)
    for key in SHAPE:
        assert back[key] == data[key], key


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_failed_export_leaves_the_earlier_one_whole(trained, tmp_path):
    """An export into an earlier one that fails while it reads the checkpoint (here a
    truncated data file, read shard by shard) leaves the earlier export as it was, byte for
    byte, and the next export replaces it."""
    import shutil

    from editrain.errors import CheckpointError
    from editrain.hf_checkpoint import export_checkpoint

    run = tmp_path / "run"
    shutil.copytree(trained["llama"] / "checkpoints", run / "checkpoints")
    out = tmp_path / "out"
    export_checkpoint(run, out, max_shard_bytes=20_000)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    data = max((run / "checkpoints").glob("*/*.distcp"), key=lambda f: f.stat().st_size)
    whole = data.read_bytes()
    data.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match=r"export: cannot read .*: EOFError\(\) \(damaged "
                                              r"or cut short\)$") as e:
        export_checkpoint(run, out, max_shard_bytes=20_000)
    assert "\n" not in str(e.value)
    after = {f.name: f.read_bytes() for f in out.iterdir() if not f.name.endswith(".partial")}
    assert after.keys() - {"editrain_export.json"} == before.keys() - {"editrain_export.json"}
    assert all(after[k] == v for k, v in before.items() if k != "editrain_export.json")
    data.write_bytes(whole)
    done = export_checkpoint(run, out)  # one file now: the shards of before are gone
    assert sorted(f.name for f in out.iterdir()) == sorted([*done.files, "editrain_export.json"])
    assert not [f for f in out.iterdir() if f.name.endswith(".partial")]


def _main(capsys, *argv: str) -> tuple[int, str, str]:
    """``editrain ARGV`` in this process (export and sample start no workers): the exit code,
    stdout and stderr."""
    from editrain.cli import main

    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_export_and_sample_from_the_cli(trained, tmp_path, capsys, monkeypatch):
    from editrain.hf_checkpoint import EXPORT_RECORD, ModelWeights
    from editrain.sample import generate, load_for_sampling

    run = trained["llama"]
    out = tmp_path / "r1"
    # README's export (into RUN_DIR/export, by the fixture) and sample ran as commands;
    # the rest runs main() in this process: the same parsing, errors and exit codes
    code, stdout, _ = _main(capsys, "export", run, out, "--replica", "1")
    assert code == 0 and "(replica 1)" in stdout and (out / EXPORT_RECORD).is_file()
    (out / "mine.txt").write_text("user file")
    code, stdout, err = _main(capsys, "export", run, out)  # an earlier export is replaced
    assert code == 0, err
    assert _main(capsys, "export", run, tmp_path / "global")[0] == 0
    assert "the global model" in (out / "README.md").read_text()
    assert (out / "mine.txt").read_text() == "user file"  # never deleted
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    code, _, err = _main(capsys, "export", run, other)
    assert code == 2 and "is not empty and is not an earlier export" in err
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    code, _, err = _main(capsys, "export", run, tmp_path / "r9", "--replica", "9")
    assert code == 2 and "holds no replica 9" in err
    # every file of an export is read and written without following a link: a link put
    # in place of one of an earlier export's files is refused by name, its target intact
    for name in ("model.safetensors", "config.json", "README.md", EXPORT_RECORD):
        linked = tmp_path / f"linked-{name}"
        assert _main(capsys, "export", run, linked)[0] == 0
        target = tmp_path / f"target-{name}"
        target.write_text("theirs")
        (linked / name).unlink()
        (linked / name).symlink_to(target)
        code, _, err = _main(capsys, "export", run, linked)
        assert code == 2 and str(linked / name) in err and len(err.splitlines()) == 1, err
        assert target.read_text() == "theirs"
    # --overwrite removes RUN_DIR/export and RUN_DIR/tokenizer as editrain's own, and
    # refuses by name when a user's file is in one of them
    from editrain.rundir import foreign_entry

    assert foreign_entry(run / "export") is None and foreign_entry(run / "tokenizer") is None
    (run / "export" / "notes.md").write_text("mine")
    try:
        assert foreign_entry(run / "export") == run / "export" / "notes.md"
    finally:
        (run / "export" / "notes.md").unlink()
    # --dtype bfloat16: the same weights rounded, and config.json says so (transformers
    # loads them as they are); the default is float32, as trained
    code, _, err = _main(capsys, "export", run, tmp_path / "bf16", "--dtype", "bfloat16")
    assert code == 0, err
    from safetensors.torch import load_file

    half, full = (load_file(tmp_path / d / "model.safetensors") for d in ("bf16", "global"))
    assert half.keys() == full.keys() and all(
        half[k].dtype == torch.bfloat16 and torch.equal(half[k], full[k].to(torch.bfloat16))
        for k in half)
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "global" / "config.json").read_text())["dtype"] == "float32"
    loaded_half = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert {p.dtype for p in loaded_half.parameters()} == {torch.bfloat16}
    with pytest.raises(SystemExit) as stop:  # argparse's own refusal, before any work
        _main(capsys, "export", run, tmp_path / "x", "--dtype", "int8")
    assert stop.value.code == 2 and "invalid choice: 'int8'" in capsys.readouterr().err
    # several shards with their index: transformers reads them; the checkpoint is read one
    # shard's tensors at a time (an export needs the memory of a shard, not of the model)
    loads: list[list[str]] = []
    whole = ModelWeights.load

    def load(self, names=None):
        got = whole(self, names)
        loads.append(sorted(got))
        return got

    monkeypatch.setattr(ModelWeights, "load", load)
    many = tmp_path / "many"
    assert _main(capsys, "export", run, many, "--max-shard-size", "20KB")[0] == 0
    monkeypatch.undo()
    index = json.loads((many / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(index.values()))
    assert len(shards) == len(loads) >= 3
    to_hf = {to_hf_name(n): n for names in loads for n in names}
    assert sorted(sorted(to_hf[k] for k, f in index.items() if f == shard)
                  for shard in shards) == sorted(loads)
    for shard in shards:
        held = load_file(many / shard)
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held.values()) \
            <= 20_000, shard
    one = file_tensors(tmp_path / "global")
    assert {k: torch.equal(t, one[k]) for k, t in file_tensors(many).items()} == \
        dict.fromkeys(one, True)  # the same tensors as the one-file export, bitwise
    x = tokens()
    with torch.no_grad():
        theirs = transformers.AutoModelForCausalLM.from_pretrained(many)(input_ids=x).logits
    torch.testing.assert_close(_global_logits(run, x), theirs, rtol=RTOL, atol=ATOL)
    code, _, err = _main(capsys, "export", run, tmp_path / "none", "--max-shard-size", "0.5B")
    assert code == 2 and err.strip().endswith(
        'export --max-shard-size: "0.5B" is not a size of at least 1 byte (a number and B, KB, '
        "MB, GB, TB, KiB, MiB, GiB or TiB: 5GB, 500MiB)") and not (tmp_path / "none").exists()
    # sample: greedy is the argmax chain of the global model, from the checkpoint and from
    # the export alike
    loaded = load_for_sampling(run)
    prompt = loaded.tokenizer.encode(PROMPT).ids
    new = generate(loaded.model, prompt, 12, eos_id=loaded.eos_id, max_len=loaded.max_len)
    greedy = PROMPT + loaded.tokenizer.decode(new) + "\n"
    code, stdout, err = _main(capsys, "sample", run, "--prompt", PROMPT,
                              "--max-new-tokens", "12")
    assert code == 0 and stdout == greedy, err
    assert trained["readme_sample"].startswith(PROMPT)  # README's command, from the export
    hot = ["sample", run / "export", "--prompt", PROMPT, "--max-new-tokens", "12",
           "--temperature", "1.5", "--top-k", "20", "--seed", "3"]
    first, again = _main(capsys, *hot), _main(capsys, *hot)
    assert first[0] == 0 and first[1] == again[1]  # seeded
    code, _, err = _main(capsys, "sample", run, "--prompt", "x", "--temperature", "-1")
    assert code == 2 and "--temperature: must be >= 0" in err


def test_top_k_one_is_greedy_and_generation_stops_at_eos():
    from editrain.sample import generate

    class Fixed(torch.nn.Module):
        def forward(self, x):  # the next token is always (last + 1) % 5
            logits = torch.full((1, x.shape[1], 5), -10.0)
            logits[0, :, :] = torch.nn.functional.one_hot((x[0] + 1) % 5, 5) * 20.0 - 10.0
            return logits

    assert generate(Fixed(), [0], 6) == [1, 2, 3, 4, 0, 1]
    assert generate(Fixed(), [0], 6, temperature=2.0, top_k=1, seed=9) == [1, 2, 3, 4, 0, 1]
    assert generate(Fixed(), [0], 6, eos_id=3) == [1, 2, 3]
    assert generate(Fixed(), [3], 2, max_len=1) == [4, 0]
    with pytest.raises(ValueError, match="no token"):
        generate(Fixed(), [], 3)


def test_any_positive_temperature_samples_and_top_k_holds_at_infinity():
    """``--temperature`` takes any number >= 0: one too small for float32 (1e-40) or
    rounding to a float32 0 (1e-300) samples the most likely token (it was NaN
    probabilities: a RuntimeError traceback, exit 1), and ``inf`` samples uniformly among
    the ``--top-k`` most likely (the cut kept every token: the logits divided by inf were
    all 0)."""
    from editrain.sample import generate

    class Ranked(torch.nn.Module):
        def forward(self, x):  # (last + 1) % 5 the most likely, then (last + 2) % 5, ...
            ranks = (torch.arange(5) - x[0, :, None] - 1) % 5
            return -ranks[None].float()

    for tiny in (1e-40, 1e-300, 5e-324):
        assert generate(Ranked(), [0], 6, temperature=tiny, seed=1) == [1, 2, 3, 4, 0, 1]
    ids = [0] + generate(Ranked(), [0], 200, temperature=float("inf"), top_k=2, seed=2)
    steps = [(b - a) % 5 for a, b in zip(ids, ids[1:], strict=False)]
    assert set(steps) == {1, 2}  # both of the top 2, nothing else (each 1/2: all 200 seen)


def _metaspace_llama(out: Path) -> list[str]:
    """A Llama directory with a SentencePiece-style tokenizer (Llama 2's, Mistral's: ``▁``
    for a space, Metaspace's decoder dropping the first one of a text): one token per
    word, every word token beginning with ``▁``. Returns the words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = "once upon a time there was fox dog river city light dark".split()
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"▁{w}" for w in words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.add_special_tokens(specials)  # left out of decoded text
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**SHAPE, "vocab_size": len(vocab)})
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                         bos_token="<s>", eos_token="</s>").save_pretrained(out)
    return words


def test_sample_keeps_the_space_between_the_prompt_and_a_sentencepiece_token(tmp_path, capsys):
    """``editrain sample`` prints the new tokens as they read after the prompt: with a
    SentencePiece-style tokenizer every word token starts with its space, which the
    decoder drops at the start of a text, so decoding the new tokens alone glued the first
    one to the prompt (``once upon atime``)."""
    from tokenizers import Tokenizer

    from editrain.sample import continuation

    words = _metaspace_llama(tmp_path / "llama")
    prompt = "once upon a"
    code, out, err = _main(capsys, "sample", tmp_path / "llama", "--prompt", prompt,
                           "--max-new-tokens", "8")
    assert code == 0, err
    new = out.removeprefix(prompt).removesuffix("\n")
    assert new.startswith(" ") and new.split() and set(new.split()) <= set(words), out
    tok = Tokenizer.from_file(str(tmp_path / "llama" / "tokenizer.json"))
    ids = tok.encode(prompt).ids
    assert continuation(tok, ids, tok.encode(" time there").ids) == " time there"
    assert continuation(tok, ids, []) == ""


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_resume_restores_the_run_not_the_directory(trained, dirs):
    """--resume of an init_from run continues from its checkpoint: the weights are the
    run's, not the directory's (init_from seeds step 0 only)."""
    run = trained["llama"]
    cont = dirs["root"] / "run_cont"
    _train(dirs, cont, dirs["llama"], "--resume", str(run), steps=6)
    summary = json.loads((cont / "summary.json").read_text())
    assert summary["steps"] == 6
    rows = [json.loads(line) for line in (cont / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r and not r.get("replayed")][:1] == [5]


def test_a_trained_bpe_is_exported_as_a_tokenizer_transformers_reads(dirs, tmp_path):
    """A run without a model directory's tokenizer trains a BPE: RUN_DIR/tokenizer gets a
    tokenizer_config.json naming its end-of-text token, which AutoTokenizer reads."""
    from editrain.data.tokenizer import train_bpe_tokenizer
    from editrain.hf_checkpoint import save_run_tokenizer

    tok = train_bpe_tokenizer(dirs["corpus"].read_text().splitlines(), 300)
    tok.save(str(tmp_path / "tokenizer.json"))
    out = save_run_tokenizer(tmp_path / "run", tmp_path / "tokenizer.json")
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    assert loaded.eos_token == EOT and loaded.eos_token_id == tok.token_to_id(EOT)
    text = "The of and to in is that."
    assert loaded(text).input_ids == tok.encode(text).ids
    assert loaded.decode(tok.encode(text).ids) == text


def test_a_fault_tolerant_runs_directory_names_its_checkpoints(tmp_path):
    """``export``/``sample`` of a fault-tolerant run's directory: its groups keep their
    checkpoints apart (``replica{r}/checkpoints/``); the global model comes from the latest
    of any group (the lowest group at equal steps), ``--replica R`` from group R's latest,
    where that replica is replica 0. (tests/test_fault_tolerance.py exports a real one.)"""
    from editrain.checkpoint import MARKER
    from editrain.errors import CheckpointError
    from editrain.hf_checkpoint import find_checkpoint

    run = tmp_path / "ft"

    def ckpt(group: int, step: int) -> Path:
        path = run / f"replica{group}" / "checkpoints" / f"step_{step:08d}"
        path.mkdir(parents=True)
        (path / MARKER).write_text("{}")
        return path

    ckpt(0, 4), ckpt(1, 4)
    g0, g1 = ckpt(0, 8), ckpt(1, 8)
    (run / "replica2").mkdir()  # a group that died before its first checkpoint
    assert find_checkpoint(run) == (g0, None)
    assert find_checkpoint(run, replica=1) == (g1, 0)
    later = ckpt(1, 12)
    assert find_checkpoint(run) == (later, None)
    assert find_checkpoint(run / "replica0", replica=0) == (g0, 0)  # a group: a run
    with pytest.raises(CheckpointError, match=r"^sample --replica: .* replica group 2 has no "
                                              r"checkpoint \(groups with checkpoints: 0, 1\)$"):
        find_checkpoint(run, "sample", replica=2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"^export: .*empty\" is neither a complete "
                                              r"checkpoint .* a fault-tolerant run's\)$"):
        find_checkpoint(tmp_path / "empty")


def test_the_run_keeps_the_models_own_generation_config(tmp_path):
    """The tokenizer may come from another model (data.tokenizer) than the weights
    (model.init_from): the run keeps the weights' generation_config.json, its settings
    with the ids of the run's tokenizer (<|endoftext|>, 400: its own name another
    tokenizer's tokens), else the tokenizer's directory's as it is."""
    from editrain.hf_checkpoint import save_run_tokenizer

    tok_dir, model_dir = tmp_path / "tok", tmp_path / "model"
    for d, eos in ((tok_dir, 7), (model_dir, [2, 3])):
        d.mkdir()
        (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eos,
                                                             "max_length": 99}))
    (tok_dir / "tokenizer.json").write_text(big_tokenizer(tmp_path).read_text())
    for run, model, eos in (("r1", model_dir, 400), ("r2", None, 7)):
        out = save_run_tokenizer(tmp_path / run, tok_dir / "tokenizer.json", tok_dir, model)
        kept = json.loads((out / "generation_config.json").read_text())
        assert (kept["eos_token_id"], kept["max_length"]) == (eos, 99)


def test_an_export_with_a_models_tokenizer_keeps_its_generation_config(
        llama3_eos, tmp_path):
    """A model of its own shape (no model.init_from) trained with the Llama 3 style
    directory's tokenizer (data.tokenizer): the export's generation config is that
    directory's as it is, its two end-of-text ids included (they name this tokenizer's
    tokens), and config.json has the tokenizer's own ids. The export replaced the list by
    the tokenizer's one eos."""
    import dataclasses

    from editrain.hf_checkpoint import export_checkpoint, save_run_tokenizer

    run = tmp_path / "run"
    llama = dataclasses.asdict(llama_config_from_hf(read_config(llama3_eos)))
    _one_process_run(run, llama, {"data": {"tokenizer": str(llama3_eos)}})
    save_run_tokenizer(run, llama3_eos / "tokenizer.json", llama3_eos, None)
    export_checkpoint(run, tmp_path / "out")
    assert (tmp_path / "out" / "generation_config.json").read_bytes() == \
        (llama3_eos / "generation_config.json").read_bytes()
    got, source = _special_ids(tmp_path / "out"), _special_ids(llama3_eos)
    assert got["generation"][1] == [0, 301] and got["tokenizer"] == source["tokenizer"]
    assert got["config"] == got["tokenizer"] and _in_vocabulary(tmp_path / "out")


# ---------------------------------------------------------------------------- special tokens
BOT, EOT_ID = "<|begin_of_text|>", "<|eot_id|>"


@pytest.fixture(scope="module")
def llama3_eos(dirs) -> Path:
    """A Llama 3 style directory: its own begin-of-text token, and a config (and generation
    config) naming two end-of-text ids while its tokenizer's eos is the end of a turn, as
    Llama 3 Instruct's do; its pad token is the BPE's end-of-text."""
    from editrain.data.tokenizer import train_bpe_tokenizer

    out = dirs["root"] / "llama3_eos"
    tok = train_bpe_tokenizer(dirs["corpus"].read_text().splitlines(), 300)
    tok.add_special_tokens([BOT, EOT_ID])
    bos, eot = tok.token_to_id(BOT), tok.token_to_id(EOT_ID)
    config = transformers.LlamaConfig(**SHAPE, bos_token_id=bos, eos_token_id=[0, eot])
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOT, eos_token=EOT_ID,
                                         pad_token=EOT).save_pretrained(out)
    return out


def _one_process_run(run: Path, model_cfg: dict, cfg: dict) -> None:
    """A run directory with one checkpoint that no training wrote: replica 0's weights of
    the model ``model_cfg`` describes (editrain's Llama where it has ``n_layers``), which an
    export reads where there are no anchors, and ``cfg`` as the run's configuration."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from editrain.checkpoint import MARKER
    from editrain.models.hf import HFCausalLM
    from editrain.models.llama import LlamaConfig

    ckpt = run / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    model = (Llama(LlamaConfig(**model_cfg)) if "n_layers" in model_cfg
             else HFCausalLM.from_config_dict(model_cfg))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"replica0": {"model": dict(model.named_parameters())}}, checkpoint_id=ckpt,
                 no_dist=True)
    (ckpt / MARKER).write_text(json.dumps({"format": 3, "step": 1, "method": "edit",
                                           "model": model_cfg, "config": cfg}))


def _init_from_run(run: Path, model_dir: Path, tok_dir: Path) -> None:
    """A run that started from ``model_dir`` with ``tok_dir``'s tokenizer (the directory
    itself unless ``data.tokenizer`` names another), its tokenizer kept as training keeps
    it."""
    import dataclasses

    from editrain.hf_checkpoint import save_run_tokenizer

    cfg = {"model": {"init_from": str(model_dir)},
           "data": {"tokenizer": None if tok_dir == model_dir else str(tok_dir)}}
    llama = dataclasses.asdict(llama_config_from_hf(read_config(model_dir)))
    _one_process_run(run, llama, cfg)
    save_run_tokenizer(run, tok_dir / "tokenizer.json", tok_dir, model_dir)


def _special_ids(path: Path) -> dict[str, tuple]:
    """(bos, eos, pad) ids as transformers reads a directory's config, the generation
    config its model generates with (generation_config.json, else made from the config)
    and its tokenizer."""
    def ids(obj) -> tuple:
        return obj.bos_token_id, obj.eos_token_id, obj.pad_token_id

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    return {"config": ids(transformers.AutoConfig.from_pretrained(path)),
            "generation": ids(model.generation_config),
            "tokenizer": ids(transformers.AutoTokenizer.from_pretrained(path))}


def _in_vocabulary(out: Path) -> bool:
    """Every special-token id the export's config.json and generation_config.json write is
    null or below the config's vocab_size."""
    config = json.loads((out / "config.json").read_text())
    files = [config] + ([json.loads((out / "generation_config.json").read_text())]
                        if (out / "generation_config.json").is_file() else [])
    values = [v for f in files for key in ("bos_token_id", "eos_token_id", "pad_token_id")
              for v in (f.get(key) if isinstance(f.get(key), list) else [f.get(key)])]
    return all(v is None or 0 <= v < config["vocab_size"] for v in values)


@pytest.mark.parametrize("name", ["llama", "llama3_eos", "qwen"])
def test_an_export_has_the_special_token_ids_of_the_directory_it_started_from(
        dirs, llama3_eos, name, tmp_path):
    """A run from a directory with that directory's tokenizer: config.json, the generation
    config and the tokenizer of the export give the directory's bos/eos/pad ids, which
    need not be the tokenizer's own (the Llama's config says 1 and 2, its tokenizer 0;
    Llama 3's eos is a list; Qwen's config names none). The export took eos and bos from
    the tokenizer and dropped the rest."""
    from editrain.hf_checkpoint import export_checkpoint
    from editrain.rundir import foreign_entry

    source = llama3_eos if name == "llama3_eos" else dirs[name]
    run = tmp_path / "run"
    if name == "qwen":  # another architecture: the marker holds its config.json
        model_cfg = {k: v for k, v in read_config(source).items() if k != "transformers_version"}
        _one_process_run(run, model_cfg, {"model": {"init_from": str(source)}})
        from editrain.hf_checkpoint import save_run_tokenizer

        save_run_tokenizer(run, source / "tokenizer.json", source, source)
    else:
        _init_from_run(run, source, source)
    assert foreign_entry(run / "tokenizer") is None  # the record is the run's own file
    export_checkpoint(run, tmp_path / "out")
    assert _special_ids(tmp_path / "out") == _special_ids(source)
    assert _in_vocabulary(tmp_path / "out")
    # a run older than RUN_DIR/tokenizer: the tokenizer and the ids from the directory
    shutil.rmtree(run / "tokenizer")
    export_checkpoint(run, tmp_path / "old")
    assert (tmp_path / "old" / "config.json").read_bytes() == \
        (tmp_path / "out" / "config.json").read_bytes()
    if name == "llama3_eos":
        assert _special_ids(source)["config"][1] == [0, 301]


def test_an_export_with_another_models_tokenizer_has_that_tokenizers_ids(
        dirs, llama3_eos, tmp_path):
    """A run from the Llama 3 style directory with another tokenizer (data.tokenizer: the
    Qwen directory's, eos and bos <|endoftext|>, no pad): config.json, the generation config
    (the model's own, kept for its settings) and the tokenizer agree on that tokenizer's ids.
    The generation config kept the directory's eos ids [0, 301], another tokenizer's. A
    record of the directory's ids that an earlier job of the run directory wrote, with the
    directory's tokenizer, is not taken for this tokenizer's."""
    from editrain.hf_checkpoint import export_checkpoint, save_run_tokenizer

    _init_from_run(tmp_path / "run", llama3_eos, dirs["qwen"])
    export_checkpoint(tmp_path / "run", tmp_path / "out")
    got = _special_ids(tmp_path / "out")
    assert got == dict.fromkeys(got, (0, 0, None))
    rerun = tmp_path / "rerun"  # an earlier job recorded the directory's ids
    save_run_tokenizer(rerun, llama3_eos / "tokenizer.json", llama3_eos, llama3_eos)
    assert (rerun / "tokenizer" / "model_token_ids.json").is_file()
    _init_from_run(rerun, llama3_eos, dirs["qwen"])
    assert not (rerun / "tokenizer" / "model_token_ids.json").exists()
    export_checkpoint(rerun, tmp_path / "out2")
    assert (tmp_path / "out2" / "config.json").read_bytes() == \
        (tmp_path / "out" / "config.json").read_bytes()
    generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert {k: v for k, v in generation.items() if "token_id" not in k} == {
        k: v for k, v in json.loads((llama3_eos / "generation_config.json").read_text()).items()
        if "token_id" not in k}  # its other settings stay the model's


def test_an_export_writes_null_for_a_special_token_the_tokenizer_lacks(dirs, tmp_path):
    """A GPT-2 from model.hf_config (its class's default ids 50256, past this vocabulary
    of 320) trained with a tokenizer naming an eos token only: the export names that eos,
    and null for bos and pad, as AutoTokenizer reads them. The export kept bos 50256."""
    from editrain.hf_checkpoint import export_checkpoint, save_run_tokenizer
    from editrain.models.hf import read_hf_config

    gpt2 = tmp_path / "gpt2"
    transformers.GPT2Config(vocab_size=320, n_positions=64, n_embd=32, n_layer=2,
                            n_head=4).save_pretrained(gpt2)
    model_cfg = {k: v for k, v in read_hf_config(gpt2).items() if k != "transformers_version"}
    assert model_cfg["bos_token_id"] == 50256
    tok_dir = tmp_path / "tok"
    fast = transformers.AutoTokenizer.from_pretrained(dirs["qwen"])
    transformers.PreTrainedTokenizerFast(tokenizer_object=fast.backend_tokenizer,
                                         eos_token=EOT).save_pretrained(tok_dir)
    run = tmp_path / "run"
    _one_process_run(run, model_cfg, {"model": {"hf_config": str(gpt2)},
                                      "data": {"tokenizer": str(tok_dir)}})
    save_run_tokenizer(run, tok_dir / "tokenizer.json", tok_dir, None)
    export_checkpoint(run, tmp_path / "out")
    got = _special_ids(tmp_path / "out")
    assert got == dict.fromkeys(got, (None, 0, None))
    assert _in_vocabulary(tmp_path / "out")


def test_a_tokenizer_file_alone_is_exported_with_its_own_end_of_text(dirs, tmp_path):
    """A run whose data.tokenizer is a tokenizer.json alone, its end of text ``</s>`` (a
    Llama 2 tokenizer's; the corpus separates documents with it): the export's tokenizer
    and config name ``</s>`` and its id. The run kept a tokenizer_config.json naming
    ``<|endoftext|>``, which this tokenizer lacks, and every export of the run was refused
    ("its tokenizer files name the eos token '<|endoftext|>', which its tokenizer.json does
    not hold"), with nothing the user could correct."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from editrain.hf_checkpoint import export_checkpoint, save_run_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(dirs["corpus"].read_text().splitlines(), trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok_file = tmp_path / "tokenizer.json"
    tok.save(str(tok_file))
    model_cfg = {k: v for k, v in read_config(dirs["qwen"]).items()
                 if k != "transformers_version"}
    run = tmp_path / "run"
    _one_process_run(run, model_cfg, {"model": {"hf_config": str(dirs["qwen"])},
                                      "data": {"tokenizer": str(tok_file)}})
    save_run_tokenizer(run, tok_file, None, None)
    export_checkpoint(run, tmp_path / "out")
    eos = tok.token_to_id("</s>")
    assert _special_ids(tmp_path / "out") == {"config": (eos, eos, None),
                                              "generation": (eos, eos, None),
                                              "tokenizer": (eos, eos, None)}
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").eos_token == "</s>"


@pytest.mark.parametrize("file, key, value, allowed", [
    ("model_token_ids.json", "eos_token_id", 320, "0 to 319, or a non-empty list"),
    ("model_token_ids.json", "eos_token_id", [0, 320], "0 to 319, or a non-empty list"),
    ("model_token_ids.json", "eos_token_id", [], "0 to 319, or a non-empty list"),
    ("model_token_ids.json", "bos_token_id", -1, "0 to 319, or null"),
    ("model_token_ids.json", "pad_token_id", True, "0 to 319, or null"),
    ("model_token_ids.json", "bos_token_id", [1], "0 to 319, or null"),
    ("generation_config.json", "eos_token_id", [0, 999], "0 to 319, or a non-empty list"),
    ("generation_config.json", "pad_token_id", "2", "0 to 319, or null"),
])
def test_an_id_outside_the_vocabulary_is_refused_before_the_export_writes(
        dirs, file, key, value, allowed, tmp_path):
    """An id that is not a token of the model's 320 (RUN_DIR/tokenizer's record of the
    directory's ids, or its generation config, edited) is refused in one line naming the
    file and the field, before anything is written: an earlier export stays as it was."""
    from editrain.errors import CheckpointError
    from editrain.hf_checkpoint import export_checkpoint

    run, out = tmp_path / "run", tmp_path / "out"
    _init_from_run(run, dirs["llama"], dirs["llama"])
    export_checkpoint(run, out)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    path = run / "tokenizer" / file
    path.write_text(json.dumps({**json.loads(path.read_text()), key: value}))
    with pytest.raises(CheckpointError) as e:
        export_checkpoint(run, out)
    assert str(e.value) == (f"export: {shown(path)}: {key} is {json.dumps(value)}, not a token of "
                            f"the model's vocabulary (an id from {allowed}" + (
                                " of such ids, or null)" if "list" in allowed else ")"))
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before


def test_ids_an_export_would_refuse_are_refused_before_the_run_trains(dirs, tmp_path):
    """The ids a run keeps for its export are checked while the configuration is: a
    model.init_from config.json (or generation_config.json) naming an id past the model's
    320 (GPT-2's 50256 in a smaller vocabulary), and a data.tokenizer directory naming a pad
    token its tokenizer.json lacks, are refused in one line naming the option, the file and
    the field. The run trained to the end, and export (or checkpoint.export_final) refused
    it then."""
    allowed = "not a token of the model's vocabulary (an id from 0 to 319"
    for file, key in (("config.json", "bos_token_id"), ("generation_config.json",
                                                        "eos_token_id")):
        bad = _copy(dirs["qwen"], tmp_path / f"bad_{key}")
        data = json.loads((bad / file).read_text())
        (bad / file).write_text(json.dumps({**data, key: 50256}))
        _refused(tmp_path, bad, re.escape(f"model.init_from: {shown(bad / file)}: {key} is 50256, "
                                          f"{allowed}") + ".*; editrain export writes these "
                 "ids for transformers to read, and would refuse them after training")
    tok_dir = _copy(dirs["qwen"], tmp_path / "tok")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": "<pad>"}))
    _refused(tmp_path, dirs["llama"], re.escape(f"data.tokenizer: {shown(tok_dir)}: its tokenizer "
                                                "files name the pad token \"<pad>\""),
             tokenizer=str(tok_dir))


def test_a_tokenizer_directorys_ids_are_checked_against_editrains_own_llama(dirs, tmp_path):
    """editrain's Llama (a preset) with a data.tokenizer directory: its embedding has the
    tokenizer's rows, and a generation_config.json there naming an id past them is refused
    before the run trains. The check used a vocabulary of 0 for this model, so any
    non-negative id (10**30 too) passed until the export refused it."""
    tok_dir = _copy(dirs["qwen"], tmp_path / "tok")
    config = json.loads((tok_dir / "generation_config.json").read_text())
    (tok_dir / "generation_config.json").write_text(json.dumps({**config,
                                                                 "eos_token_id": 50256}))
    with pytest.raises(ConfigError, match=re.escape(
            f"data.tokenizer: {shown(tok_dir / 'generation_config.json')}: eos_token_id is 50256, "
            "not a token of the model's vocabulary")) as e:
        load_config(overrides={"data": {"tokenizer": str(tok_dir),
                                        "cache_dir": str(tmp_path / "cache")}})
    assert "\n" not in str(e.value)
    (tok_dir / "generation_config.json").write_text(json.dumps(config))
    load_config(overrides={"data": {"tokenizer": str(tok_dir),
                                    "cache_dir": str(tmp_path / "cache")}})


def test_an_export_into_what_editrain_keeps_for_a_run_is_refused(dirs, tmp_path):
    """OUT inside a checkpoint (which then held a directory: --resume refused the
    checkpoint, and rotation would delete the export with it), or inside a run's
    checkpoints/, ranks/, tokenizer/ or export/ (--overwrite's to delete), is refused in
    one line before anything is written; RUN_DIR/export itself, export_final's place, and a
    new entry of the run directory are fine."""
    from editrain.checkpoint import open_checkpoint
    from editrain.errors import CheckpointError
    from editrain.hf_checkpoint import export_checkpoint

    run = tmp_path / "run"
    _init_from_run(run, dirs["llama"], dirs["llama"])
    ckpt = run / "checkpoints" / "step_00000001"
    files = sorted(p.name for p in ckpt.iterdir())
    for out, inside in [(ckpt / "hf", f"lies inside the checkpoint {shown(ckpt)}"),
                        (run / "checkpoints" / "hf", f"lies in {shown(run / 'checkpoints')}"),
                        (run / "tokenizer" / "hf", f"lies in {shown(run / 'tokenizer')}"),
                        (run / "export" / "hf", f"lies in {shown(run / 'export')}")]:
        with pytest.raises(CheckpointError,
                           match=re.escape(f"export: OUT {shown(out)} {inside}")) as e:
            export_checkpoint(run, out)
        assert "\n" not in str(e.value) and not out.exists()
    assert sorted(p.name for p in ckpt.iterdir()) == files
    open_checkpoint(ckpt)  # still a checkpoint --resume takes
    for out in (run / "export", run / "hf"):
        assert export_checkpoint(run, out).out == out


def test_a_special_token_the_tokenizer_lacks_is_refused(dirs, llama3_eos, tmp_path):
    """A tokenizer whose files name a pad token its tokenizer.json does not hold (which
    AutoTokenizer adds past the vocabulary) is refused in one line, nothing written; the
    export left it out of config.json."""
    from editrain.errors import CheckpointError
    from editrain.hf_checkpoint import export_checkpoint

    tok_dir = tmp_path / "tok"
    shutil.copytree(dirs["qwen"], tok_dir)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                "pad_token": "<pad>"}))
    _init_from_run(tmp_path / "run", llama3_eos, tok_dir)
    with pytest.raises(CheckpointError, match=r"^export: .*tokenizer\": its tokenizer files "
                                              r'name the pad token "<pad>", which its '
                                              r"tokenizer.json does not hold; name a token "
                                              r"of its vocabulary$"):
        export_checkpoint(tmp_path / "run", tmp_path / "out")
    assert not (tmp_path / "out").exists()
