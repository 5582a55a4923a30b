"""Golden runs: deterministic runs of today's engine, replayed against committed fixtures.

Issue #31 rebuilds the sync engine; these runs, recorded before the rebuild, are what the
rebuilt code must reproduce bitwise. Each case is a small run (``editrain train`` with the
tiny preset for 12 steps on a synthetic corpus generated here, so that the data does not
depend on the Python version; the DDP case through the library API on the reference
model) whose fixture ``tests/golden/<case>.json`` holds:

* the machine fingerprint it was recorded on (:func:`fingerprint`);
* the identity of the tokenised training data (size and sha256);
* per run directory (one, or one per replica group with ``--ft``; per rank for the DDP
  case, which runs through the library API): every step row of ``metrics.jsonl`` and every
  rank's row of ``ranks/rank*.jsonl`` without timings (step, tokens, loss, lr, validation
  loss), every sync entry without timings (weights, norms, outlier flags, z-scores,
  clipping coefficients, bytes, fragment, launch step, quorum, ...), the final validation
  loss, and the final state: a sha256 per tensor of the final checkpoint (parameters,
  inner optimizer, anchors, outer optimizer, error feedback, launch snapshots), the float64
  sum of squares of each group of them, and the anomaly detectors' state.

On the machine fingerprint the fixture was recorded on every value must be equal
bitwise. On another machine (floating point can differ by ~1e-5 in single elements
across CPU models, see ``tests.reference.reference_mismatches``) losses are compared to a
relative 1e-5, the other floats to 1e-4, integers and flags exactly, and the tensor
checksums not at all: a warning says so, unless that machine has fixtures of its own
(``golden/machines/``), which it then replays bitwise. Regenerate every fixture with
``EDITRAIN_REGEN_GOLDEN=1 python -m pytest tests/test_golden.py``; add a machine's with
``EDITRAIN_REGEN_GOLDEN=machine`` (docs/golden.md). Values a main fixture took from
another machine's replay (its ``patched`` list) are compared to tolerance but there.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import editrain
from editrain.checkpoint import list_checkpoints, read_marker
from tests.reference import batch, loss_on, make_inner, make_model
from tests.test_checkpoint import train

GOLDEN = Path(__file__).resolve().parent / "golden"
MACHINES = GOLDEN / "machines"
"""Fixtures of the cases recorded on other machines than the main ones, so that a replay
there is bitwise too: ``<case>.<machine_key>.json``."""
REGEN = os.environ.get("EDITRAIN_REGEN_GOLDEN", "")
"""``1``: record the main fixtures (and drop the other machines'); ``machine``: add this
machine's fixtures, each checked first against the main one to tolerance."""
# Off the recording machine: losses to a relative LOSS_RTOL; every other float (norms,
# weights, z-scores divide by small standard deviations) to FLOAT_RTOL.
LOSS_RTOL = 1e-5
FLOAT_RTOL = 1e-4
FLOAT_ATOL = 1e-7

# Settings every CLI case shares (tests.test_checkpoint.train adds the tiny preset, the
# vocabulary, batch 4 x 32 tokens and 1024 evaluation tokens).
COMMON = ["--data.val_tokens", "8192", "--steps", "12", "--train.eval_every", "6"]
# The penalty: softmax weights at T = 0.05 and the anomaly detector from the second sync;
# alpha 0.5 lets its mean follow the norms' growth under the LR warm-up, so that only some
# syncs flag outliers (with the default 0.02 every unit of every later sync is skipped).
PENALTY = ["--sync.ewma_warmup_steps", "1", "--sync.ewma_alpha", "0.5",
           "--sync.weight_softmax_temperature", "0.05"]
# The outer optimizer EDiT and A-EDiT had by default when the fixtures were recorded
# (#35 made SGD at lr 1 without momentum and H = 20 their defaults): pinned, so that the
# runs are the recorded ones.
NESTEROV = ["--sync.outer_optim_kwargs={lr=0.7,momentum=0.9,nesterov=true}"]
R2 = ["--nproc", "2", "--shard-size", "1"]
R2S2 = ["--nproc", "4", "--shard-size", "2"]

CLI_CASES: dict[str, list[str]] = {
    # The penalty and a clip that bites at these norms, after 2 synchronous warm-up steps.
    "edit": [*R2S2, "--method", "edit", "--sync.local_sgd_sync_interval", "3",
             "--sync.local_sgd_warmup_steps", "2", "--sync.clip_pseudo_grad", "0.2",
             *PENALTY, *NESTEROV],
    # Two fragments merged two steps after their launch, int8 with error feedback.
    "streaming": [*R2S2, "--method", "edit", "--sync.local_sgd_sync_interval", "4",
                  "--sync.fragments", "2", "--sync.overlap_steps", "2", "--sync.merge",
                  "keep_local", "--sync.comm_dtype", "int8", "--model.tie_embeddings",
                  "false", *PENALTY, *NESTEROV],
    # Non-blocking A-EDiT on a forced schedule: replica r syncs every 2 + r of its steps
    # and merges one step after the launch (docs/decisions.md, A-EDiT).
    # Threshold 6: its z-scores reach 5.7-6.7 at the third sync, which flags some only.
    "aedit": [*R2, "--method", "aedit", "--sim.step_schedule=[2,3]", "--sync.overlap_steps",
              "1", *PENALTY, "--sync.ewma_threshold", "6", *NESTEROV],
    "diloco": [*R2, "--method", "diloco", "--sync.local_sgd_sync_interval", "4"],
    "post_local_sgd": [*R2, "--method", "post_local_sgd", "--sync.local_sgd_sync_interval",
                       "4"],
    # GTA with per-shard magnitude sparsification (half the entries kept).
    "gta": [*R2S2, "--method", "edit", "--sync.local_sgd_sync_interval", "4",
            "--sync.gta.reducer", "gta", "--sync.gta.sparsification_method", "magnitude",
            "--sync.gta.density", "0.5", *PENALTY, *NESTEROV],
    # 2 replicas x 1 shard x 2 tensor-parallel ranks, gradient and pseudo-gradient clipping.
    "tp": ["--nproc", "4", "--shard-size", "1", "--tp-size", "2", "--method", "edit",
           "--sync.local_sgd_sync_interval", "4", "--train.grad_clip", "0.5",
           "--sync.clip_pseudo_grad", "0.2", *PENALTY, *NESTEROV],
    # torchft, no failure: each replica group its own job with its own run directory.
    "ft": ["--ft", *R2, "--method", "edit", "--sync.local_sgd_sync_interval", "4",
           "--dist.ft_heartbeat_timeout_s", "2", *PENALTY, *NESTEROV],
}
# Sync fields a case leaves out, with why. Under --ft a round's index is the largest of
# the members' counters, which count a replica's attempts at its first quorum too: how
# many depends on start-up timing (1 or 2 here), so it is a label, not a result.
UNSTABLE_SYNC_FIELDS = {"ft": ("sync",)}


# ----------------------------------------------------------------------------- recording
def fingerprint() -> dict[str, str]:
    """What decides the bits of a CPU float result: the CPU (its name and, since a virtual
    machine may name every generation alike, vendor, family, model and stepping), the
    vector instructions torch's kernels use, torch's build and the architecture."""
    cpu: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip() and cpu:
                break  # the first processor's block is enough
            key, _, value = line.partition(":")
            if key.strip() in ("vendor_id", "cpu family", "model", "model name", "stepping"):
                cpu[key.strip()] = value.strip()
    except OSError:
        pass
    cpu = cpu or {"model name": platform.processor() or "unknown"}
    return {"cpu": " / ".join(f"{k}: {v}" for k, v in sorted(cpu.items())),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "machine": platform.machine()}


def _timing(key: str) -> bool:
    """Whether a log field measures time (or a rate): those differ between runs."""
    k = key.lower()
    return (k.endswith("_s") or k.endswith("_ms") or any(
        w in k for w in ("time", "wait", "hidden", "per_s", "elapsed", "mfu", "flops")))


def _untimed(value: Any) -> Any:
    """``value`` without the timing fields of its dicts, at any depth."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if not _timing(k)}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def corpus(path: Path, docs: int = 240) -> Path:
    """Write a synthetic corpus (JSON lines, one document a row): sentences drawn from a
    small grammar by a 64-bit LCG, so the text is the same on every host and Python (the
    default corpus is the interpreter's own standard library)."""
    nouns = ("cat", "dog", "bird", "river", "stone", "tree", "house", "road", "cloud",
             "ship", "lamp", "garden", "window", "market", "letter", "engine")
    verbs = ("sees", "finds", "follows", "builds", "moves", "paints", "carries", "opens",
             "watches", "counts", "keeps", "sends")
    adjs = ("red", "old", "quiet", "small", "bright", "heavy", "cold", "green", "slow")
    places = ("near the hill", "by the sea", "in the town", "under the bridge",
              "at the gate", "over the field")
    state = 0x5EED

    def draw(n: int) -> int:
        nonlocal state
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        return (state >> 33) % n

    def pick(words: tuple[str, ...]) -> str:
        return words[draw(len(words))]

    rows = []
    for d in range(docs):
        sentences = []
        for _ in range(8 + draw(32)):
            s = f"the {pick(adjs)} {pick(nouns)} {pick(verbs)} the {pick(nouns)}"
            if draw(3) == 0:
                s += f" {pick(places)}"
            if draw(4) == 0:
                s += f" {draw(100)} times"
            sentences.append(s + ".")
        rows.append(json.dumps({"text": f"story {d}: " + " ".join(sentences) + "\n"}))
    path.write_text("\n".join(rows) + "\n")
    return path


def _digest(t: torch.Tensor) -> str:
    """sha256 (16 hex digits) of a tensor's dtype, shape and bytes."""
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _group(key: str) -> str:
    """The group a state tensor's norm is summed in: a replica's parameters or inner
    optimizer, or the engine's anchors, outer optimizer state and the rest."""
    parts = key.split(".")
    if parts[0] == "engine":
        if parts[-1] == "anchor":
            return "anchors"
        return "outer" if "outer" in parts else "engine_other"
    # "replica<r>.model.<fqn>" in a checkpoint, "model.<fqn>" on one rank
    return ".".join(parts[:2]) if parts[0].startswith("replica") else parts[0]


def summarise_state(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Digests, per-group float64 sums of squares and the detectors of a flat state.

    Args:
        tensors: flattened key -> tensor; a uint8 tensor under ``...ranks.rank<N>`` is a
            rank's plain engine state (JSON), of which the anomaly detectors are kept
            (the rest holds clocks).
    """
    digests, norms, detectors = {}, {}, {}
    for key in sorted(tensors):
        t = tensors[key]
        if ".ranks.rank" in key and t.dtype == torch.uint8:
            plain = json.loads(bytes(t.cpu().numpy()).decode())
            if plain.get("detectors") is not None:
                detectors[key.rsplit(".", 1)[1]] = plain["detectors"]
            continue
        digests[key] = _digest(t)
        if t.is_floating_point():
            g = _group(key)
            norms[g] = norms.get(g, 0.0) + float(t.double().pow(2).sum())
    return {"tensors": digests, "sumsq": norms, "detectors": detectors}


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, read on one process, by flattened key (the
    library's safe reader: metadata allowlist, ``weights_only`` tensor reads)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from editrain.safe_load import SafeFileSystemReader, SafeLoadPlanner, read_metadata

    md = read_metadata(ckpt)
    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype)
           for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "no process group: loading in one process" is meant
        warnings.simplefilter("ignore")
        dcp.load(out, storage_reader=SafeFileSystemReader(ckpt), planner=SafeLoadPlanner(),
                 no_dist=True)
    return out


def record_run_dir(run: Path, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """What a CLI run directory holds that is not a timing (see the module docstring).

    Args:
        run: the run directory (of one replica group with --ft).
        drop: sync fields to leave out (:data:`UNSTABLE_SYNC_FIELDS`).
    """
    rows = [_untimed(r) for r in _jsonl(run / "metrics.jsonl") if "event" not in r]
    syncs = [{k: v for k, v in s.items() if k not in drop}
             for s in (r.pop("sync", None) for r in rows) if s is not None]
    # A round that ended between steps (completed by finish() after the last step) has a
    # row of its own: its entry is among the syncs, and the row, which then holds only the
    # step and tokens, is no step.
    steps = [r for r in rows if "loss" in r or "val_loss" in r]
    ranks = {}
    for path in sorted((run / "ranks").glob("rank*.jsonl")):
        ranks[path.stem] = [_untimed({k: v for k, v in r.items() if k != "unix_time"})
                            for r in _jsonl(path) if "event" not in r]
    ckpt = list_checkpoints(run)[-1]
    summary = json.loads((run / "summary.json").read_text())
    return {"steps": steps, "syncs": syncs, "ranks": ranks,
            "final_val_loss": summary["final_val_loss"], "checkpoint": ckpt.name,
            "state": summarise_state(checkpoint_tensors(ckpt))}


def record_cli(name: str, cache: Path, data: Path, tmp: Path) -> dict[str, Any]:
    """Run CLI case ``name`` and record it."""
    run = tmp / name
    train(cache, run, "--data.path", str(data), *COMMON, *CLI_CASES[name])
    dirs = sorted(p for p in run.glob("replica*") if p.is_dir()) or [run]
    marker = read_marker(list_checkpoints(dirs[0])[-1])
    return {"case": name, "args": [*COMMON, *CLI_CASES[name]],
            "data": marker["train_data"],
            "runs": {p.name if p != run else ".":
                     record_run_dir(p, UNSTABLE_SYNC_FIELDS.get(name, ())) for p in dirs}}


# ----------------------------------------------------------------------------- the DDP case
# 2 replicas x 2 ranks, each a full copy under DistributedDataParallel over its replica,
# through the public API (examples/ddp.py): the penalty and clipping on, 1 warm-up step.
DDP_STEPS = 9
DDP_SYNC = dict(method="edit", local_sgd_warmup_steps=1, local_sgd_sync_interval=2,
                pseudo_gradnorm_reduce=True, weight_softmax_temperature=0.02,
                skip_anomaly=True, ewma_alpha=0.5, ewma_warmup_steps=2, ewma_threshold=3.0,
                clip_pseudo_grad=0.05,
                outer_optim_kwargs={"lr": 0.7, "momentum": 0.9, "nesterov": True})


def _flatten(tree: Any, prefix: str, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensor leaves of a nested state dict by dotted key (DTensors whole)."""
    if isinstance(tree, torch.Tensor):
        out[prefix] = tree.full_tensor() if hasattr(tree, "full_tensor") else tree
    elif isinstance(tree, dict):
        for k, v in tree.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _flatten(v, f"{prefix}.{i}", out)
    return out


def _ddp_worker(rank: int, world: int) -> dict[str, Any]:
    info = editrain.init_mesh(shard_size=2)
    model = make_model(tied=True)
    wrapped = DistributedDataParallel(model, process_group=info.shard_mesh.get_group())
    engine = editrain.edit(wrapped, info, editrain.SyncConfig(split_root=False, **DDP_SYNC))
    opt = editrain.StatefulPostLocalSGDOptimizer(make_inner(wrapped.parameters(), "adamw"),
                                                 engine)
    steps, syncs = [], []
    with engine:
        for step in range(DDP_STEPS):
            loss = loss_on(wrapped, batch(rank, step, 0))
            loss.backward()
            opt.step()
            opt.zero_grad()
            steps.append({"step": step + 1, "loss": float(loss)})
            syncs += [dict(_untimed(e), after_step=step + 1) for e in engine.pop_sync_log()]
        engine.finish(force=True)
        syncs += [dict(_untimed(e), after_step="finish") for e in engine.pop_sync_log()]
        with torch.no_grad():  # held out: a batch no rank trained on, the same everywhere
            val = float(loss_on(model, batch(10**6, 0, 0)))
        # The engine's state sits under the optimizer's "editrain" key: named "engine" here,
        # as in a checkpoint, so that it is grouped the same way.
        whole = opt.state_dict()
        engine_state = whole.pop("editrain")
        state = _flatten({"model": model.state_dict(), "optim": whole,
                          "engine": engine_state}, "", {})
        return {"steps": steps, "syncs": syncs, "final_val_loss": val,
                "state": summarise_state(state)}


def record_ddp() -> dict[str, Any]:
    """Run the DDP case (one spawn of 4 processes) and record it."""
    from editrain.spawn import run_ranks

    outs = run_ranks(_ddp_worker, 4)
    return {"case": "ddp", "args": {"steps": DDP_STEPS, "sync": DDP_SYNC},
            "runs": {f"rank{r}": out for r, out in enumerate(outs)}}


# ----------------------------------------------------------------------------- comparing
def _close(path: str, want: float, got: float) -> bool:
    rtol = LOSS_RTOL if "loss" in path else FLOAT_RTOL
    return math.isclose(got, want, rel_tol=rtol, abs_tol=FLOAT_ATOL)


def _under(path: str, prefixes: tuple[str, ...]) -> bool:
    """Whether ``path`` is one of ``prefixes`` or inside one (a key or an item of it)."""
    return any(path == p or path.startswith((p + ".", p + "[")) for p in prefixes)


def differences(want: Any, got: Any, bitwise: bool, path: str = "",
                elsewhere: tuple[str, ...] = ()) -> list[str]:
    """Where ``got`` differs from the fixture ``want``: bitwise (floats by their repr,
    NaN equal to NaN) or, off the recording machine, to the tolerances above with tensor
    digests skipped. Fields ``got`` has beyond the fixture's are not compared (a rebuild
    may log more). ``elsewhere``: the paths of values the fixture took from a replay on
    another machine than this one (its ``patched`` list), compared to tolerance."""
    bitwise = bitwise and not _under(path, elsewhere)
    if not bitwise and path.endswith(".tensors"):
        return []
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{path}: expected a dict, got {got!r:.80}"]
        out = []
        for k, v in want.items():
            if k not in got:
                out.append(f"{path}.{k}: missing")
            else:
                out += differences(v, got[k], bitwise, f"{path}.{k}", elsewhere)
        return out
    if isinstance(want, list):
        if not isinstance(got, list) or len(got) != len(want):
            return [f"{path}: expected {len(want)} items, got {got!r:.120}"]
        return [d for i, (a, b) in enumerate(zip(want, got))
                for d in differences(a, b, bitwise, f"{path}[{i}]", elsewhere)]
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        same = repr(float(got)) == repr(want) or (bitwise is False and _close(path, want, got))
        return [] if same else [f"{path}: expected {want!r}, got {got!r}"]
    if type(want) is not type(got) or want != got:
        return [f"{path}: expected {want!r:.120}, got {got!r:.120}"]
    return []


# ----------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def cache(data_cache) -> Path:
    return data_cache


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return corpus(tmp_path_factory.mktemp("corpus") / "stories.jsonl")


def machine_key(fp: dict[str, str]) -> str:
    """A short name for a machine fingerprint (the file name of its own fixtures)."""
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]


def fixtures_of(name: str) -> list[Path]:
    """The fixtures of case ``name``: ``golden/<name>.json``, then those recorded on other
    machines, ``golden/machines/<name>.<machine_key>.json``."""
    return [GOLDEN / f"{name}.json", *sorted(MACHINES.glob(f"{name}.*.json"))]


def check_or_write(name: str, got: dict[str, Any]) -> None:
    """Compare with the fixture recorded on this machine (bitwise), else with the main one
    (to tolerance); or record: ``EDITRAIN_REGEN_GOLDEN=1`` writes the main fixture and
    drops the other machines' (recorded from older code), ``=machine`` adds this machine's
    once the run agrees with the main fixture to tolerance."""
    got = {**got, "fingerprint": fingerprint()}
    main = GOLDEN / f"{name}.json"
    if REGEN == "1":
        GOLDEN.mkdir(exist_ok=True)
        main.write_text(json.dumps(got, indent=1) + "\n")
        for old in fixtures_of(name)[1:]:
            old.unlink()
        return
    assert main.exists(), f"{main} missing: EDITRAIN_REGEN_GOLDEN=1 records it"
    fixtures = {p: json.loads(p.read_text()) for p in fixtures_of(name)}
    own = [p for p, f in fixtures.items() if f["fingerprint"] == got["fingerprint"]]
    path = own[0] if own and REGEN != "machine" else main
    want = fixtures[path]
    assert want["args"] == json.loads(json.dumps(got["args"])), (
        f"{name}: the case's settings changed since {path.name} was recorded; regenerate "
        "the fixtures")
    if "data" in want:
        # Another tokenizer build or corpus: the runs are not comparable at all.
        assert want["data"] == got["data"], (
            f"{name}: the training tokens differ from the recording's ({got['data']} vs "
            f"{want['data']}): tokenizer or data pipeline changed; no comparison possible")
    bitwise = want["fingerprint"] == got["fingerprint"]
    if not bitwise and REGEN != "machine":
        warnings.warn(f"{name}: recorded on {want['fingerprint']}, replayed on "
                      f"{got['fingerprint']}: losses compared to {LOSS_RTOL:g}, other floats "
                      f"to {FLOAT_RTOL:g}, tensor checksums NOT compared (EDITRAIN_REGEN_GOLDEN"
                      "=machine records this machine's fixture)", stacklevel=2)
    # Values added to the fixture from a replay on another machine (docs/golden.md,
    # "Regenerations"): bitwise only there.
    elsewhere = tuple(path for patch in want.get("patched", [])
                      if patch["fingerprint"] != got["fingerprint"] for path in patch["paths"])
    diff = differences(want["runs"], got["runs"], bitwise, "runs", elsewhere)
    mode = "bitwise (same machine)" if bitwise else "to tolerance (another machine)"
    shown = "\n".join(diff[:25]) + (f"\n... {len(diff) - 25} more" if len(diff) > 25 else "")
    assert not diff, f"{name}: {len(diff)} differences, compared {mode} with {path.name}:\n{shown}"
    if REGEN == "machine" and not bitwise:
        MACHINES.mkdir(exist_ok=True)
        (MACHINES / f"{name}.{machine_key(got['fingerprint'])}.json").write_text(
            json.dumps(got, indent=1) + "\n")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_golden_run(name: str, cache: Path, data: Path, tmp_path: Path) -> None:
    """An `editrain train` run reproduces its fixture: bitwise on the recording machine,
    to LOSS_RTOL / FLOAT_RTOL without checksums on another (see the module docstring)."""
    if name == "ft":
        pytest.importorskip("torchft")
    check_or_write(name, record_cli(name, cache, data, tmp_path))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ddp_golden_run() -> None:
    """The DDP path through the library API reproduces its fixture (same rules)."""
    check_or_write("ddp", record_ddp())


def test_comparison_rules() -> None:
    """Bitwise means the float's repr; off the recording machine a loss 1e-6 off relative
    passes, 1e-4 off fails, and digests are not compared."""
    want = {"steps": [{"loss": 2.0}], "state": {"tensors": {"a": "x"}, "sumsq": {"g": 1.0}}}
    near = {"steps": [{"loss": 2.0 * (1 + 1e-6)}],
            "state": {"tensors": {"a": "y"}, "sumsq": {"g": 1.0 + 5e-5}, "more": 1}}
    far = {"steps": [{"loss": 2.0 * (1 + 1e-4)}], "state": {"tensors": {}, "sumsq": {"g": 1.0}}}
    assert differences(want, want, True) == []
    assert len(differences(want, near, True)) == 3
    assert differences(want, near, False) == []
    assert differences(want, far, False) == [
        f".steps[0].loss: expected 2.0, got {2.0 * (1 + 1e-4)!r}"]
    assert differences({"x": [1, 2]}, {"x": [1]}, False)
    assert differences({"f": True}, {"f": 1}, True)
    assert differences({"n": float("nan")}, {"n": float("nan")}, True) == []
    # A value a fixture took from another machine's replay: to tolerance, there only.
    syncs = {"syncs": [{"norm": 1.0}, {"norm": 2.0}]}
    near_last = {"syncs": [{"norm": 1.0}, {"norm": 2.0 * (1 + 1e-6)}]}
    assert differences(syncs, near_last, True, "runs", ("runs.syncs[1]",)) == []
    assert differences(syncs, near_last, True, "runs", ("runs.syncs[0]",))
    assert differences(syncs, near_last, True, "runs", ("runs.syncs[10]",))
