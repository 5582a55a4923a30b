"""torchft's streaming DiLoCo as a peer on the real link (issue 50 item 3): the worker's
streaming options, its fragments (editrain's sync units, strided), the spec built from
the command line scripts/real_link.sh uses, and the record of a run with a torchft setting
(validation loss per link, no editrain target held against the peer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from editrain.bench import real_link, torchft_peer
from editrain.config import load_config, model_config
from editrain.config.model import sync_units
from editrain.models import Llama

COMMON = ["--method", "edit", "--sync.local_sgd_sync_interval", "10", "--steps", "60",
          "--model.preset", "tiny", "--model.tie_embeddings", "false", "--quiet"]


@pytest.mark.parametrize("spec, message", [
    ({"fragments": 3}, r"fragments must be an integer >= 1 that divides H \(10\), got 3"),
    ({"fragments": 0}, r"fragments must be an integer >= 1 that divides H \(10\), got 0"),
    ({"fragments": 2, "fragment_sync_delay": 5},
     r"fragment_sync_delay must be an integer in \[0, H / fragments\) = \[0, 5\), got 5"),
    ({"fragment_sync_delay": -1}, r"\[0, 10\), got -1"),
    ({"fragment_update_alpha": 1.5}, r"fragment_update_alpha must be a number in \[0, 1\]"),
    ({"fragment_update_alpha": True}, r"fragment_update_alpha must be a number in \[0, 1\]"),
])
def test_streaming_options_are_checked_against_h(spec, message):
    with pytest.raises(ValueError, match=message):
        torchft_peer.check_streaming(spec, 10)


def test_streaming_options_defaults_and_limits():
    assert torchft_peer.check_streaming({}, 10) == (1, 0, 0.0)
    assert torchft_peer.check_streaming(
        {"fragments": 2, "fragment_sync_delay": 4, "fragment_update_alpha": 0.5}, 10) == \
        (2, 4, 0.5)


def test_fragments_are_editrains_units_strided():
    cfg = load_config(None, {"model": {"preset": "tiny", "tie_embeddings": False}})
    model = Llama(model_config(cfg, vocab_size=64), seed=0)
    # The engine's units of this model, in its order; fragment f holds every 2nd from f.
    assert sync_units(cfg) == ["root", "tok_embeddings", "block0", "block1", "output"]
    names = {id(p): n for n, p in model.named_parameters()}
    parts = torchft_peer.model_fragments(model, 2, cfg.sync.split_root)
    got = [{names[id(p)] for p in part.parameters()} for part in parts]
    blocks = [{n for n in names.values() if n.startswith(f"layers.{i}.")} for i in (0, 1)]
    assert got[0] == {"norm.weight", "output.weight"} | blocks[0]  # root, block0, output
    assert got[1] == {"tok_embeddings.weight"} | blocks[1]  # tok_embeddings, block1
    # The model's own parameters, each in exactly one fragment (shared, not copied).
    ids = [id(p) for part in parts for p in part.parameters()]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    assert torchft_peer.model_fragments(model, 1, True) == [model]


def test_method_name_says_streaming():
    assert torchft_peer.method_name("torchft", {}) == "torchft-diloco"
    assert torchft_peer.method_name("torchft", {"fragments": 1, "fragment_sync_delay": 0}) \
        == "torchft-diloco"
    assert torchft_peer.method_name("torchft", {"fragments": 2}) == "torchft-streaming-diloco"
    assert torchft_peer.method_name("torchft", {"fragment_sync_delay": 3}) == \
        "torchft-streaming-diloco"
    assert torchft_peer.method_name("library", {}) == "diloco-library"


def test_spec_from_the_command_line(monkeypatch):
    seen = []
    monkeypatch.setattr(torchft_peer, "train_replica", seen.append)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    argv = ["--replica", "1", "--replicas", "2", "--lighthouse", "http://10.77.0.1:29556",
            "--address", "10.77.0.2", "--run-dir", "/tmp/r", "--fragments", "2",
            "--delay", "4", "--threads", "3", "--", *COMMON]
    assert torchft_peer.main(argv) == 0
    (spec,) = seen
    assert {k: spec[k] for k in ("system", "replica", "replicas", "lighthouse", "address",
                                 "run_dir", "threads", "fragments", "fragment_sync_delay",
                                 "fragment_update_alpha")} == {
        "system": "torchft", "replica": 1, "replicas": 2,
        "lighthouse": "http://10.77.0.1:29556", "address": "10.77.0.2", "run_dir": "/tmp/r",
        "threads": 3, "fragments": 2, "fragment_sync_delay": 4, "fragment_update_alpha": 0.0}
    assert spec["options"]["sync"]["local_sgd_sync_interval"] == 10
    assert spec["options"]["train"]["steps"] == 60
    assert spec["options"]["model"] == {"preset": "tiny", "tie_embeddings": False}


def test_bad_command_line_is_refused_before_any_work(monkeypatch):
    monkeypatch.setattr(torchft_peer, "train_replica", lambda spec: pytest.fail("trained"))
    base = ["--lighthouse", "http://h:1", "--run-dir", "/tmp/r", "--fragments", "2"]
    with pytest.raises(ValueError, match=r"fragment_sync_delay .* \[0, 5\), got 5"):
        torchft_peer.main([*base, "--delay", "5", "--", *COMMON])
    with pytest.raises(ValueError, match="unexpected argument"):
        torchft_peer.main([*base, "--", *COMMON, "stray"])
    with pytest.raises(SystemExit):  # no training options: argparse's one-line error
        torchft_peer.main(base)


ROOT = Path(__file__).resolve().parent.parent

FAKE_TORCHFT = """import os, sys
print("RUST_LOG at import:", os.environ.get("RUST_LOG"), flush=True)
sys.exit(0)
"""
"""A torchft that says what ``RUST_LOG`` was when it was first imported, and ends the
process there: nothing after the import runs."""

PEER_ENTRIES = {
    "lighthouse": ["-m", "editrain.bench.torchft_peer", "--serve-lighthouse", "[::]:0"],
    "diloco": ["-c", "from editrain.bench.torchft_peer import _Torchft\n"
                     "_Torchft({}, None, None, None)"],
}
"""The peer's two paths into torchft: its lighthouse (the command line
``scripts/real_link.sh`` runs) and the DiLoCo worker."""


@pytest.mark.parametrize("entry, user_value, seen", [
    ("lighthouse", None, "warn"), ("diloco", None, "warn"), ("lighthouse", "debug", "debug"),
])
def test_the_peer_imports_torchft_with_its_logs_at_warnings(tmp_path, entry, user_value,
                                                            seen):
    """The bench peer's torchft, as editrain's own, is imported with ``RUST_LOG=warn`` set
    first (torchft reads it once, then logs three info lines a sync), and a value the user
    set is kept."""
    (tmp_path / "torchft").mkdir()
    (tmp_path / "torchft" / "__init__.py").write_text(FAKE_TORCHFT)
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT)])
    if user_value is not None:
        env["RUST_LOG"] = user_value
    done = subprocess.run([sys.executable, *PEER_ENTRIES[entry]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"RUST_LOG at import: {seen}"]


def test_library_system_takes_no_streaming_options(tmp_path):
    spec = {"options": {"train": {"steps": 8}, "sync": {"local_sgd_sync_interval": 4}},
            "system": "library", "replica": 0, "replicas": 1, "run_dir": str(tmp_path),
            "threads": 1, "timeout_s": 10, "fragments": 2}
    with pytest.raises(ValueError, match="fragments: torchft's streaming DiLoCo options; "
                                         "system 'library' takes none"):
        torchft_peer.train_replica(spec)


def _run(path: Path, seconds_per_step: float, loss: float, sent: dict[str, int] | None
         ) -> None:
    """A finished 8-step run: 1,000 tokens a step, a sync every 2 steps."""
    path.mkdir(parents=True)
    rows = []
    for step in range(1, 9):
        row = {"step": step, "tokens": 1000 * step, "loss": 5.0,
               "wall_time_s": seconds_per_step * step}
        if step % 2 == 0:
            row["sync"] = {"sync": step // 2, "step": step, "wait_s": 0.0,
                           "sync_time_s": 0.0}
        rows.append(row)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = {"steps": 8, "wall_time_s": seconds_per_step * 8 + 1, "final_val_loss": loss}
    if sent:
        summary["cross_replica_bytes"] = sent
    (path / "summary.json").write_text(json.dumps(summary))


def test_the_record_puts_the_peer_beside_editrain(tmp_path):
    sent = {"rounds": 1000, "total": 1000}
    for rep in (1, 2, 3):
        _run(tmp_path / f"eager-topk2-unshaped-r{rep}", 0.1, 6.0 + rep / 100, sent)
        _run(tmp_path / f"eager-topk2-1mbit-r{rep}", 0.1, 6.1, sent)
        _run(tmp_path / f"torchft-d4-unshaped-r{rep}", 0.1, 5.5, None)
        _run(tmp_path / f"torchft-d4-1mbit-r{rep}", 0.4, 5.6 + rep / 100, None)
    assert real_link.main([str(tmp_path), "--rate", "1mbit", "--repeats", "3", "--settings",
                           "eager-topk2", "torchft-d4", "--preset", "tiny", "--H", "10",
                           "--steps", "8", "--fragments", "5"]) == 0
    record = json.loads((tmp_path / "results.json").read_text())
    peer = record["results"]["torchft-d4"]
    assert peer["kept"]["values"] == pytest.approx([0.25] * 3)
    assert peer["1mbit"]["final_val_loss"]["values"] == pytest.approx([5.61, 5.62, 5.63])
    assert peer["unshaped"]["final_val_loss"]["median"] == pytest.approx(5.5)
    ours = record["results"]["eager-topk2"]
    assert ours["unshaped"]["final_val_loss"]["values"] == pytest.approx([6.01, 6.02, 6.03])
    # editrain's targets only: the peer's numbers stand beside them, judged by no target.
    assert [t["name"].split(" ")[0] for t in record["targets"]] == ["eager-topk2"] * 2
    assert record["settings"]["fragments"] == 5
    assert record["command"].startswith("PRESET=tiny H=10 STEPS=8 EVAL_EVERY=8 FRAGMENTS=5 ")
    assert "SETTINGS='eager-topk2 torchft-d4'" in record["command"]
    table = (tmp_path / "table.md").read_text()
    assert "val loss at 1mbit" in table and "streaming DiLoCo" in table
    assert "lighthouse runs in the first namespace" in table


def test_several_rates_write_one_record_each(tmp_path):
    for rep in (1, 2, 3):
        for link, step_s in (("unshaped", 0.1), ("10mbit", 0.125), ("1mbit", 0.5)):
            _run(tmp_path / f"torchft-d1-{link}-r{rep}", step_s, 5.5, None)
    for rate, kept in (("10mbit", 0.8), ("1mbit", 0.2)):
        assert real_link.main([str(tmp_path), "--rate", rate, "--repeats", "3", "--settings",
                               "torchft-d1", "--rates", "10mbit 1mbit",
                               "--into", str(tmp_path / rate)]) == 0
        record = json.loads((tmp_path / rate / "results.json").read_text())
        assert record["results"]["torchft-d1"]["kept"]["median"] == pytest.approx(kept)
        assert "RATE='10mbit 1mbit' REPEATS=3 SETTINGS=torchft-d1" in record["command"]
    assert not (tmp_path / "results.json").exists()


def _kept(median: float) -> dict:
    return {"median": median, "min": median - 0.01, "max": median + 0.01, "n": 3}


def _peer_record(rate: str, peers: dict[str, float]) -> dict:
    results = {"eager-topk2": {"kept": _kept(0.98), rate: {"final_val_loss": _kept(6.5)}}}
    for name, kept in peers.items():
        results[name] = {"kept": _kept(kept), rate: {"final_val_loss": _kept(5.9)}}
    return {"format": 2, "scenario": "real_link", "mode": "quick", "results": results,
            "settings": {"rate": rate, "preset": "tiny", "H": 10, "steps": 60,
                         "fragments": 2}}


def test_headline_puts_the_best_delay_beside_editrain_slowest_link_last(tmp_path):
    from editrain.bench.headline import headline_rows

    slow = _peer_record("1mbit", {"torchft-d0": 0.2, "torchft-d4": 0.3})
    slow["results"]["sparse-topk2"] = {"kept": _kept(0.9),
                                       "1mbit": {"final_val_loss": _kept(6.2)}}
    loaded = [(tmp_path / "slow", slow),
              (tmp_path / "fast", _peer_record("10mbit", {"torchft-d0": 0.7,
                                                          "torchft-d4": 0.6})),
              # editrain's settings alone (no peer): not a row of this kind.
              (tmp_path / "alone", {**_peer_record("1mbit", {}), "results": {
                  "eager-topk2": {"kept": _kept(0.9)}}})]
    rows, _ = headline_rows(loaded)
    assert [(r.editrain, r.peer, [d.name for d in r.sources]) for r in rows] == [
        ("eager-topk2 0.98 [0.97-0.99]x, loss 6.5 [6.49-6.51]",
         "torchft streaming DiLoCo, delay 0 0.7 [0.69-0.71]x, loss 5.9 [5.89-5.91]", ["fast"]),
        ("eager-topk2 0.98 [0.97-0.99]x, loss 6.5 [6.49-6.51]; "
         "sparse-topk2 0.9 [0.89-0.91]x, loss 6.2 [6.19-6.21]",
         "torchft streaming DiLoCo, delay 4 0.3 [0.29-0.31]x, loss 5.9 [5.89-5.91]", ["slow"])]
    assert rows[1].what.startswith("Throughput kept on a real 1mbit link vs unshaped")
    assert rows[1].conditions == ("tiny preset, H = 10, 2 torchft fragments, 60 steps; "
                                  "median [min-max] of 3 repeats")
