"""Data: ``editrain data`` on corpora of growing size against the tokenizer's own speed.

A token-cache build reads the corpus several times (describing the documents for the
split, the tokenizer's sample, both sides encoded) but should cost little more than the
encoding itself, and its memory should not grow with the corpus. For every corpus size
this scenario measures, in one invocation, in :data:`ROUNDS` rounds, each in this order:

1. the limit: the same tokenizer's ``encode_batch_fast`` over the same files, one process
   per CPU (each single-threaded, files dealt out round robin), as tokens per second of
   wall time;
2. ``editrain data`` with that tokenizer (``--data.tokenizer``) into an empty cache;
3. ``editrain data`` training its own BPE (the default), into an empty cache.

Each of the three is judged by its fastest round (:func:`fastest`): the same rule for the
limit and the builds, so that the machine's noise favours none of them.

Each is a child process; its peak memory is the largest sum of the resident sets of the
process and its children, sampled every 0.1 s. The corpora are Python files of the
installed packages (the interpreter's ``site-packages``, then its standard library),
copied into a scratch directory (``EDITRAIN_BENCH_DATA_DIR``, default the system's
temporary directory) and repeated with a ``# copy K`` first line until the size is reached,
so no two documents are identical; they are deleted at the end.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

from editrain.bench.prose import fill, prose
from editrain.bench.runner import Bench
from editrain.bench.scenario import WRITE, Ctx, Job, Scenario, Table, Verdict
from editrain.bench.tables import fmt_bytes
from editrain.errors import spelled_env

TEXT = prose("data")
DESCRIPTION = TEXT["description"]
SPEED_TARGET = 1.5
"""A build with a given tokenizer takes at most this many times the limit's time."""
BPE_SPEED_TARGET = 2.0
"""A build that trains its BPE (on a bounded sample) takes at most this many times."""
ROUNDS = 2
"""Rounds per corpus size (limit, build with the given tokenizer, build with its own BPE,
in turn); each of the three is judged by its fastest round."""
MEMORY_TARGET = 1.5
"""Peak memory at the largest corpus at most this many times that at the smallest."""
MEASURES = {"limit": "limit ({workers} processes)",
            "given_tokenizer": "editrain data --data.tokenizer",
            "bpe": "editrain data (own BPE)"}
"""The measures of a round, in order, and how the progress line names each."""
VOCAB_SIZE = 8192
_POLL_S = 0.1
_SEED_TOKENIZER_BYTES = 4_000_000  # text the benchmark's given tokenizer is trained on


SIZES_ENV = "EDITRAIN_BENCH_DATA_SIZES"
"""Environment variable: comma-separated corpus sizes in bytes (``5e6,40e6``) instead of the
size's own, e.g. on a machine too busy for the full series."""


def corpus_sizes(mode: str) -> list[int]:
    """Bytes of text of each corpus measured at size ``mode`` (or :data:`SIZES_ENV`)."""
    given = os.environ.get(SIZES_ENV, "").strip()
    if given:
        try:
            sizes = [int(float(x)) for x in given.split(",")]
        except (ValueError, OverflowError):  # OverflowError: inf, 1e400
            sizes = []
        if not sizes or min(sizes) <= 0:
            raise ValueError(f"{spelled_env(SIZES_ENV, given)}: expected comma-separated "
                             f"positive byte counts, e.g. 5e6,40e6")
        return sizes
    return {"tiny": [300_000, 900_000], "quick": [20_000_000, 150_000_000],
            "full": [20_000_000, 150_000_000, 1_000_000_000]}[mode]


def _source_files() -> list[Path]:
    """Python files of the installed packages, then of the standard library, sorted."""
    out: list[Path] = []
    for key in ("purelib", "stdlib"):
        root = Path(sysconfig.get_paths()[key])
        out += sorted(p for p in root.rglob("*.py") if p.is_file())
    return out


def make_corpus(root: Path, size: int) -> int:
    """Write a directory of ``.py`` files of about ``size`` bytes into ``root``; return its
    bytes. Files that are not UTF-8 are left out; when the sources run out they are copied
    again under ``copyK/`` with a ``# copy K`` first line, so no two files are identical."""
    files = _source_files()
    total, copy = 0, 0
    while total < size:
        wrote = 0
        for i, path in enumerate(files):
            try:
                data = path.read_bytes()
                data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            head = f"# copy {copy}\n".encode() if copy else b""
            dest = root / f"copy{copy}" / f"{i:06d}_{path.name}"
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(head + data)
            total += len(head) + len(data)
            wrote += 1
            if total >= size:
                break
        if wrote == 0:
            raise RuntimeError("bench data: no UTF-8 Python files found to build a corpus")
        copy += 1
    return total


def _children(pid: int) -> list[int]:
    """``pid`` and all its descendants (from ``/proc``)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces: the fields after its closing parenthesis.
        parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [c for c, p in parent.items() if p in frontier]
        tree += frontier
    return tree


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (0 once they are gone)."""
    total = 0
    for p in _children(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def run_measured(argv: list[str], env: dict[str, str] | None = None,
                 timeout_s: float = 7200.0) -> dict[str, Any]:
    """Run ``argv``; return its ``stdout``, ``returncode``, wall ``seconds`` and
    ``peak_rss`` (largest sampled resident size of its process tree)."""
    t0 = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], tree_rss(proc.pid))
            done.wait(_POLL_S)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    seconds = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    done.set()
    sampler.join()
    # CPU seconds of the process and of the children it waited for (each of the limit's
    # workers, a build's): unlike wall time, hardly changed by other work on the machine.
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    return {"stdout": out, "stderr": err[-2000:], "returncode": proc.returncode,
            "seconds": seconds, "cpu_seconds": cpu, "peak_rss": peak[0]}


_WORKER = """
import sys
from pathlib import Path
from tokenizers import Tokenizer

tok = Tokenizer.from_file(sys.argv[1])
tok.encode_special_tokens = True  # as a build encodes
files = sorted(Path(sys.argv[2]).rglob("*.py"))[int(sys.argv[3])::int(sys.argv[4])]
tokens, batch, chars = 0, [], 0
for i, path in enumerate(files):
    batch.append(path.read_text(encoding="utf-8"))
    chars += len(batch[-1])
    if chars >= 1 << 20 or i == len(files) - 1:
        tokens += sum(len(e.ids) + 1 for e in tok.encode_batch_fast(batch))
        batch, chars = [], 0
print(tokens)
"""
"""One worker of the limit: files ``index::workers`` of the corpus (sorted), encoded in
batches of about 1 MB, one separator per file counted. Plain Python and ``tokenizers``
only, so that it starts as fast as it can."""
_LIMIT = """
import subprocess, sys
n = int(sys.argv[3])
procs = [subprocess.Popen([sys.executable, "-c", sys.argv[4], sys.argv[1], sys.argv[2],
                           str(i), str(n)], stdout=subprocess.PIPE, text=True)
         for i in range(n)]
outs = [p.communicate()[0] for p in procs]
if any(p.returncode for p in procs):
    sys.exit(1)
print(sum(int(o) for o in outs))
"""


def _measured(r: dict[str, Any], tokens: int, **more: Any) -> dict[str, Any]:
    """A measure that succeeded: its ``tokens`` and what :func:`run_measured` timed."""
    return {"ok": True, "tokens": tokens, "seconds": r["seconds"], "peak_rss": r["peak_rss"],
            "tokens_per_s": tokens / r["seconds"], "cpu_seconds": r["cpu_seconds"], **more}


def measure_limit(tokenizer: Path, corpus: Path, workers: int) -> dict[str, Any]:
    """The tokenizer's own speed over the corpus: ``workers`` single-threaded processes."""
    env = dict(os.environ, RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    r = run_measured([sys.executable, "-c", _LIMIT, str(tokenizer), str(corpus),
                      str(workers), _WORKER], env=env)
    if r["returncode"] != 0:
        return {"ok": False, "error": r["stderr"]}
    return _measured(r, int(r["stdout"].strip()), workers=workers)


def fastest(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one measure (the limit, or a build) as one: the fastest per token of
    those that succeeded, with every round's time (``runs_seconds``, in order; None for a
    failed one) and the largest peak memory of them (``peak_rss``: memory is judged by its
    worst round); the first round when none succeeded."""
    ok = [r for r in runs if r["ok"]]
    if not ok:
        return runs[0]
    best = dict(min(ok, key=lambda r: r["seconds"] / r["tokens"]))
    best["runs_seconds"] = [r.get("seconds") if r["ok"] else None for r in runs]
    best["peak_rss"] = max(r["peak_rss"] for r in ok)
    return best


def measure_build(corpus: Path, cache: Path, tokenizer: Path | None) -> dict[str, Any]:
    """``editrain data`` over ``corpus`` into the empty cache ``cache``."""
    argv = [sys.executable, "-m", "editrain", "data", "--json", "--data.path", str(corpus),
            "--data.max_bytes", "none", "--data.cache_dir", str(cache),
            "--data.vocab_size", str(VOCAB_SIZE)]
    if tokenizer is not None:
        argv += ["--data.tokenizer", str(tokenizer)]
    r = run_measured(argv)
    try:
        info = json.loads(r["stdout"]) if r["returncode"] == 0 else None
        # The build alone, without the command's start (the interpreter, its imports, the
        # configuration's checks) and report: what meta.json recorded.
        build_s = (json.loads((Path(info["cache_dir"]) / "meta.json").read_text())
                   ["build_seconds"] if info else None)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    if info is None:
        return {"ok": False, "error": r["stderr"]}
    train, val = info["train"]["tokens"], info["val"]["tokens"]
    return _measured(r, train + val, documents=info["documents"], build_seconds=build_s,
                     train_tokens=train, val_tokens=val)


def _seed_tokenizer(corpus: Path, out: Path) -> Path:
    """A BPE tokenizer trained on the first files of ``corpus``: the given tokenizer."""
    from editrain.data.tokenizer import train_bpe_tokenizer

    def texts():
        chars = 0
        for path in sorted(corpus.rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            yield text
            chars += len(text)
            if chars >= _SEED_TOKENIZER_BYTES:
                return

    train_bpe_tokenizer(texts(), VOCAB_SIZE).save(str(out))
    return out


def _setup(bench: Bench) -> dict[str, Any]:
    return {"sizes": corpus_sizes(bench.mode), "workers": os.cpu_count() or 1, "points": []}


def _runs(ctx: Ctx):
    """Per corpus size, :data:`ROUNDS` rounds of the limit and both builds, in turn; the
    record is written after each size, so that a long series cut short keeps its finished
    sizes. The corpora and the tokenizer live in a scratch directory, removed at the end."""
    bench, workers = ctx.bench, ctx.workers
    scratch = Path(tempfile.mkdtemp(prefix="editrain-bench-data-",
                                    dir=os.environ.get("EDITRAIN_BENCH_DATA_DIR")))
    try:
        tokenizer = None
        for size in ctx.sizes:
            corpus = scratch / f"corpus-{size}"
            nbytes = make_corpus(corpus, size)
            if tokenizer is None:
                tokenizer = _seed_tokenizer(corpus, scratch / "tokenizer.json")
            rounds: dict[str, list[dict[str, Any]]] = {key: [] for key in MEASURES}
            for k in range(ROUNDS):
                at = f"corpus of {nbytes / 1e6:,.1f} MB, round {k + 1} of {ROUNDS}"
                for key, what in MEASURES.items():
                    rounds[key].append((yield Job(
                        f"{key}-{size}-r{k}", title=f"{at}: {what.format(workers=workers)}",
                        start=partial(_measure, key, corpus, tokenizer, scratch / "cache",
                                      workers))))
            shutil.rmtree(corpus, ignore_errors=True)
            ctx.points.append(_point(nbytes, rounds))
            bench.log(json.dumps(ctx.points[-1], default=str))
            yield WRITE
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(key: str, corpus: Path, tokenizer: Path, cache: Path, workers: int,
             bench: Bench, job: Job) -> dict[str, Any]:
    """A job's start: say what runs, then measure it (a dict, not a training run)."""
    bench.log(job.title)
    if key == "limit":
        return measure_limit(tokenizer, corpus, workers)
    return measure_build(corpus, cache, tokenizer if key == "given_tokenizer" else None)


def _point(nbytes: int, rounds: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One corpus size: each measure by its fastest round, the builds against the limit."""
    point = {"bytes": nbytes, **{key: fastest(runs) for key, runs in rounds.items()},
             "rounds": ROUNDS, "load_average": os.getloadavg()}
    limit = point["limit"]
    for build in (point["given_tokenizer"], point["bpe"]):
        if limit["ok"] and build["ok"]:
            at_limit = build["tokens"] / limit["tokens_per_s"]  # the limit's seconds for them
            build["time_vs_limit"] = build["seconds"] / at_limit
            build["build_vs_limit"] = build["build_seconds"] / at_limit
            # CPU seconds per token against the limit's: what the build costs beyond
            # encoding, whatever else ran on the machine meanwhile.
            build["cpu_vs_limit"] = (build["cpu_seconds"] / build["tokens"]
                                     / (limit["cpu_seconds"] / limit["tokens"]))
    return point


def _round_times(measure: dict[str, Any], rounds: int) -> str:
    """Every round's seconds of one measure, ``" / "``-joined ("failed" for a failed one,
    every one when none succeeded)."""
    times = measure.get("runs_seconds") or [None] * rounds
    return " / ".join("failed" if t is None else f"{t:.1f}" for t in times)


def _peak(x: dict[str, Any]) -> str | None:
    return x.get("peak_rss") and fmt_bytes(x["peak_rss"])


def _builds(key: str) -> list[tuple[str, Any]]:
    """The columns of one build: its speed, against the limit, its peak."""
    return [(f"{'given tok' if key == 'given_tokenizer' else 'own BPE'}: tokens/s",
             lambda p: p[key].get("tokens_per_s")),
            ("x limit time", lambda p: p[key].get("time_vs_limit")),
            ("build only", lambda p: p[key].get("build_vs_limit")),
            ("x limit CPU", lambda p: p[key].get("cpu_vs_limit")),
            ("peak", lambda p: _peak(p[key]))]


TABLE = Table("editrain data against the tokenizer's own speed", [
    ("corpus", lambda p: f"{p['bytes'] / 1e6:,.0f} MB"),
    ("tokens", lambda p: p["given_tokenizer"].get("tokens")),
    ("limit tokens/s", lambda p: p["limit"].get("tokens_per_s")),
    ("limit peak", lambda p: _peak(p["limit"])),
    *_builds("given_tokenizer"), *_builds("bpe"),
    ("load", lambda p: "{:.1f}".format(p["load_average"][0]))],
    rows=lambda ctx: ctx.results["points"])


def _memory_growth(points: list[dict[str, Any]]) -> dict[str, float]:
    """Each build's peak memory at the largest corpus over that at the smallest."""
    memory: dict[str, float] = {}
    if len(points) >= 2:
        for key in ("given_tokenizer", "bpe"):
            first, last = points[0][key].get("peak_rss"), points[-1][key].get("peak_rss")
            if first and last:
                memory[key] = last / first
    return memory


def _verdict(ctx: Ctx) -> Verdict:
    points, verdict = ctx.results["points"], Verdict()
    ok = [p for p in points if p["given_tokenizer"].get("time_vs_limit") is not None]
    for key, target, name in (("given_tokenizer", SPEED_TARGET, "given"),
                              ("bpe", BPE_SPEED_TARGET, "bpe")):
        timed = [p[key]["time_vs_limit"] for p in points
                 if p[key].get("time_vs_limit") is not None]
        if timed:
            verdict.targets.append({"name": fill(TEXT["targets"][name], target=target),
                                    "met": max(timed) <= target,
                                    "detail": f"worst {max(timed):.2f}x"})
    memory = _memory_growth(points)
    if memory:
        verdict.targets.append({
            "name": fill(TEXT["targets"]["memory"], target=MEMORY_TARGET,
                         last=points[-1]["bytes"] / 1e6, first=points[0]["bytes"] / 1e6),
            "met": max(memory.values()) <= MEMORY_TARGET,
            "detail": ", ".join(f"{k} {v:.2f}x" for k, v in memory.items())})
    if ok and ctx.bench.mode != "tiny":
        last = ok[-1]
        verdict.headline.append(fill(
            TEXT["headline"], megabytes=last["bytes"] / 1e6, given=last["given_tokenizer"],
            workers=ctx.workers, peak=fmt_bytes(last["given_tokenizer"]["peak_rss"]),
            growth=fill(TEXT["growth"], growth=memory["given_tokenizer"],
                        megabytes=points[0]["bytes"] / 1e6) if "given_tokenizer" in memory
            else ""))
    names = (("limit", "limit"), ("given", "given_tokenizer"), ("bpe", "bpe"))
    for p in points:
        verdict.findings.append(fill(TEXT["finding"], megabytes=p["bytes"] / 1e6, **{
            k: p[key].get("seconds", float("nan")) for k, key in names}) + fill(
            TEXT["rounds"], **{k: _round_times(p[key], p["rounds"]) for k, key in names}))
    return verdict


def _notes(ctx: Ctx) -> list[str]:
    notes = fill(TEXT["notes"], vocab=VOCAB_SIZE, workers=ctx.workers, rounds=ROUNDS)
    if os.environ.get(SIZES_ENV, "").strip():
        notes.append(fill(TEXT["sizes_note"], env=SIZES_ENV,
                          value=os.environ[SIZES_ENV].strip()))
    return notes


SCENARIO = Scenario(
    name="data", description=DESCRIPTION, setup=_setup, runs=_runs,
    measure=lambda ctx: {"points": ctx.points, "workers": ctx.workers},
    tables=[TABLE], judge=_verdict, notes=_notes,
    settings=lambda ctx: {"sizes": [p["bytes"] for p in ctx.points], "workers": ctx.workers,
                          "vocab_size": VOCAB_SIZE},
    methods=lambda ctx: ["limit", "given_tokenizer", "bpe"], checks=lambda ctx: [],
    size_caveat=False)
