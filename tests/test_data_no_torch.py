"""Issue 49: ``editrain data`` never imports torch.

Importing torch (and ``torch.distributed.tensor``, which the sync engine needs) took about
5 s of a 17 s ``editrain data`` on a 20 MB corpus, for a command that only reads text and
writes token files. Each case runs the console script's own entry point,
``editrain.entry.main``, in a fresh interpreter on a tiny corpus and then lists the torch
modules that got imported: there must be none. ``editrain train`` and the other commands
may import torch as before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from editrain.data.tokenizer import train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]

DRIVER = """\
import json, sys
from editrain.entry import main
sys.argv = ["editrain", *json.loads(sys.argv[1])]
try:
    rc = main()
except SystemExit as e:  # argparse's --help
    rc = e.code
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
with open(REPORT, "w") as f:
    json.dump({"rc": rc, "torch": loaded}, f)
"""


def run_data(args: list[str], tmp_path: Path) -> tuple[dict, subprocess.CompletedProcess]:
    """``editrain ARGS`` through ``editrain.entry.main`` in a new interpreter; returns
    its exit status and imported torch modules, and the finished process."""
    report = tmp_path / "report.json"
    code = DRIVER.replace("REPORT", repr(str(report)))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(args)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert report.exists(), proc.stderr[-2000:]
    return json.loads(report.read_text()), proc


def _corpus(root: Path) -> Path:
    """A few small text files: enough for a documents split and a 300-id BPE."""
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi "
             "omicron pi rho sigma tau upsilon phi chi psi omega").split()
    for i in range(12):
        lines = [" ".join(words[(i * 7 + j * 3 + k) % len(words)] for k in range(3 + j % 9))
                 for j in range(40 + i)]
        path = root / f"family{i % 4}" / f"doc{i:02d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    return root


def _data_args(tmp_path: Path, *tokenizer: str) -> list[str]:
    """``editrain data --json`` on a tiny corpus, with a 300-id BPE of its own unless
    ``tokenizer`` is the option that names one."""
    return ["data", "--json", "--quiet", "--data.path", str(_corpus(tmp_path / "corpus")),
            "--data.cache_dir", str(tmp_path / "cache"), "--data.val_tokens", "256",
            *(tokenizer or ("--data.vocab_size", "300"))]


def test_data_help_imports_no_torch(tmp_path):
    result, proc = run_data(["data", "--help"], tmp_path)
    assert result["rc"] == 0 and "usage: editrain data" in proc.stdout, proc.stderr[-2000:]
    assert result["torch"] == [], f"editrain data --help imported {result['torch'][:5]}"


def test_data_build_with_its_own_bpe_imports_no_torch(tmp_path):
    result, proc = run_data(_data_args(tmp_path), tmp_path)
    assert result["rc"] == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    assert info["tokenizer_trained_on"] == "train" and info["train"]["tokens"] > 0
    assert result["torch"] == [], f"editrain data imported {result['torch'][:5]}"


def test_data_build_with_a_model_directory_tokenizer_imports_no_torch(tmp_path):
    """``data.tokenizer`` as a model directory: its tokenizer_config.json is read for the
    end-of-text token (the Hugging Face directory helpers), still without torch."""
    model = tmp_path / "model"
    model.mkdir()
    texts = [p.read_text() for p in sorted(_corpus(tmp_path / "seed").rglob("*.txt"))]
    train_bpe_tokenizer(texts, 300).save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    result, proc = run_data(_data_args(tmp_path, "--data.tokenizer", str(model)), tmp_path)
    assert result["rc"] == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    assert info["tokenizer_trained_on"] is None and info["vocab_size"] == 300
    assert result["torch"] == [], f"editrain data imported {result['torch'][:5]}"


@pytest.mark.parametrize("bad", [["--data.val_tokens", "-1"], ["--train.seq_len", "100000"]])
def test_a_refused_data_option_imports_no_torch_and_says_so(tmp_path, bad):
    """Validation runs in full (the model's sequence length too) and names the option."""
    result, proc = run_data(["data", "--data.cache_dir", str(tmp_path / "c"), *bad], tmp_path)
    assert result["rc"] == 2 and bad[0][2:] in proc.stderr, proc.stderr[-2000:]
    assert result["torch"] == [], f"editrain data imported {result['torch'][:5]}"


@pytest.mark.parametrize("method", ["sync", "post_local_sgd", "diloco", "edit", "aedit"])
@pytest.mark.parametrize("name", [None, "none", "sgd", "SGD"])
def test_the_outer_optimizers_left_unchecked_are_those_torch_accepts(method, name):
    """:meth:`SyncConfig._check_outer` skips the construction (and torch) for no kwargs and
    no optimizer or SGD: the full check passes there, for every method's kwargs too."""
    from editrain.sync.config import SELF_CHECKED_OUTER, SyncConfig
    from editrain.sync.methods import METHOD_DEFAULTS
    from editrain.sync.outer import check_outer, outer_kwargs, resolve_optimizer_class

    assert (name.lower() if name else name) in SELF_CHECKED_OUTER
    effective = METHOD_DEFAULTS[method]["outer_optim_class"] if name is None else name
    cls = resolve_optimizer_class(effective)
    check_outer(cls, outer_kwargs(cls, None))  # what the skipped check would have run
    resolved = SyncConfig(method=method, outer_optim_class=name).resolve()
    check_outer(cls, resolved.outer_optim_kwargs)  # and what the engine will construct


def test_given_outer_kwargs_are_still_checked_by_the_optimizer():
    from editrain.errors import ConfigError
    from editrain.sync.config import SyncConfig

    with pytest.raises(ConfigError, match=r"sync.outer_optim_kwargs: SGD rejects .*'bogus'"):
        SyncConfig(outer_optim_kwargs={"lr": 0.5, "bogus": 1})
    with pytest.raises(ConfigError, match=r"sync.outer_optim_kwargs.lr: must be > 0"):
        SyncConfig(outer_optim_class="sgd", outer_optim_kwargs={"lr": 0.0})
    with pytest.raises(ConfigError, match=r"sync.outer_optim_class: unknown optimizer"):
        SyncConfig(outer_optim_class="nosuch")


def test_data_resume_prepares_that_runs_corpus(tmp_path):
    """``editrain data --resume RUN`` (no --config) reads the run's own ``config.toml`` with
    the options given over it, as ``train --resume RUN`` does: the run's corpus, cache
    directory and vocabulary; before, --resume was accepted and ignored, and the default
    corpus was tokenised into the default cache. A --resume that names nothing is refused."""
    from editrain.config import load_config, to_dict
    from editrain.config.toml_io import dumps_toml

    run, cache = tmp_path / "run", tmp_path / "cache"
    run.mkdir()
    cfg = load_config(None, {"data": {"path": str(_corpus(tmp_path / "corpus")),
                                      "cache_dir": str(cache), "val_tokens": 256,
                                      "vocab_size": 300}})
    (run / "config.toml").write_text(dumps_toml({**to_dict(cfg), "run_dir": str(run)}))
    result, proc = run_data(["data", "--json", "--quiet", "--resume", str(run),
                             "--data.vocab_size", "280"], tmp_path)
    assert result["rc"] == 0, proc.stderr[-2000:]
    info = json.loads(proc.stdout)
    assert Path(info["cache_dir"]).parent == cache and info["vocab_size"] == 280
    assert result["torch"] == [], f"editrain data imported {result['torch'][:5]}"
    result, proc = run_data(["data", "--resume", str(tmp_path / "nothing")], tmp_path)
    assert result["rc"] == 2 and "--resume" in proc.stderr and "not found" in proc.stderr
