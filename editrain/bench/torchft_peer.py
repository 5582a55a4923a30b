"""One peers worker: torchft's DiLoCo, or editrain's public API, on editrain's model and data.

``python -m editrain.bench.torchft_peer --spec SPEC.json`` trains replica ``replica`` of
``replicas`` in one process, in one training loop written once for both systems:
``system = "torchft"`` (the default) wraps the inner optimizer in
``torchft.local_sgd.DiLoCo`` around a ``torchft.Manager`` (gloo) joined to the lighthouse,
the process set up as editrain's workers are (``editrain.malloc.keep_freed_memory``);
``system = "library"`` runs editrain's ``diloco`` as a library user does:
``editrain.init_mesh(shard_size=1)`` (from the ``torchrun`` variables),
``editrain.parallelize``, ``editrain.edit``, ``engine.after_backward()``, ``engine.step()``.
Everything else is what an ``editrain train`` run of ``diloco`` takes from the same
options: the model, token cache, the replica's stream, inner optimizer and schedule,
clipping, H and outer optimizer, ``threads`` intra-op threads; the validation loss is
computed over editrain's windows (``editrain.data.eval_batches``) at the start and the end.
It writes ``ranks/rank{R}.jsonl`` and ``replica{R}.json``, and on replica 0
``metrics.jsonl`` and ``summary.json``, as the bench reads them from an editrain run.

SPEC.json holds ``options`` (nested training options), ``system``, ``replica``,
``replicas``, ``lighthouse`` (torchft only), ``run_dir``, ``threads`` and ``timeout_s``
(the collective and quorum timeout); torchft only, optional: streaming DiLoCo's
``fragments``, ``fragment_sync_delay`` and ``fragment_update_alpha`` (see
:func:`check_streaming`), and ``address``, where the others reach this replica's store and
manager (default ``localhost``). The fragments are editrain's sync units strided as
``sync.fragments`` strides them, one outer optimizer each, as editrain keeps one per unit.

Without ``--spec`` the spec comes from the command line (``scripts/real_link.sh``), the
training options after ``--``; ``--serve-lighthouse HOST:PORT --replicas N`` runs a
lighthouse until it is killed::

    python -m editrain.bench.torchft_peer --replica 0 --replicas 2 \
        --lighthouse http://10.77.0.1:29556 --address 10.77.0.1 --run-dir DIR \
        --fragments 2 --delay 1 -- --method edit --steps 60 ...
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from editrain.argv import CommandParser
from editrain.metrics import MetricsWriter, RankLog, to_json

SYSTEMS = {"torchft": "torchft-diloco", "library": "diloco-library"}
"""The worker's ``system`` values and the method name its summary records."""
STREAMING_KEYS = ("fragments", "fragment_sync_delay", "fragment_update_alpha")
"""The spec's streaming DiLoCo options (torchft only)."""


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[Any]) -> dict[str, float]:
    """``val_loss`` (weighted by targets, as editrain's trainer computes it), ``val_tokens``
    and ``eval_time_s`` over ``batches`` (``editrain.data.eval_batches``)."""
    from editrain.models import causal_lm_loss

    t0 = time.perf_counter()
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        x = batch.tokens
        total[0] += causal_lm_loss(model(x[:, :-1]), x[:, 1:]).double() * batch.targets
        total[1] += batch.targets
    model.train()
    return {"val_loss": float(total[0] / total[1]), "val_tokens": int(total[1]),
            "eval_time_s": time.perf_counter() - t0}


def check_streaming(spec: dict[str, Any], h: int) -> tuple[int, int, float]:
    """The spec's ``(fragments, fragment_sync_delay, fragment_update_alpha)`` (absent: 1,
    0, 0.0), checked against H before any work: torchft syncs one fragment every ``H / F``
    steps, so ``F`` divides H, and a fragment's all-reduce must land before that
    fragment's next one, so the delay is below ``H / F``.

    Raises:
        ValueError: one line naming the field and what is allowed.
    """
    fragments = spec.get("fragments", 1)
    delay = spec.get("fragment_sync_delay", 0)
    alpha = spec.get("fragment_update_alpha", 0.0)
    if not isinstance(fragments, int) or fragments < 1 or h % fragments:
        raise ValueError(f"fragments must be an integer >= 1 that divides H ({h}), "
                         f"got {fragments!r}")
    if not isinstance(delay, int) or not 0 <= delay < h // fragments:
        raise ValueError(f"fragment_sync_delay must be an integer in [0, H / fragments) = "
                         f"[0, {h // fragments}), got {delay!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"fragment_update_alpha must be a number in [0, 1], got {alpha!r}")
    return fragments, delay, float(alpha)


def model_fragments(model: torch.nn.Module, fragments: int,
                    split_root: bool) -> list[torch.nn.Module]:
    """The model's own parameters (shared, not copied) as ``fragments`` modules for
    torchft, as editrain's ``sync.fragments`` groups them: editrain's sync units (the
    root's parameters, then every unit module in order; ``split_root`` as
    ``sync.split_root``), fragment ``f`` holding every ``fragments``-th unit from ``f``.
    One fragment is the model itself."""
    from editrain.sync.setup import find_root_params, unit_modules

    if fragments == 1:
        return [model]
    modules = unit_modules(model, model.blocks(), split_root)
    root = find_root_params(model, [m for _, m in modules])
    units: list[list[tuple[str, torch.nn.Module | torch.nn.Parameter]]] = []
    if root:
        units.append([(f"root{i}", p) for i, p in enumerate(root)])
    units += [[(name, module)] for name, module in modules]
    out = []
    for f in range(fragments):
        holder = torch.nn.Module()
        for unit in units[f::fragments]:
            for name, item in unit:
                if isinstance(item, torch.nn.Parameter):
                    holder.register_parameter(name, item)
                else:
                    holder.add_module(name.replace(".", "_"), item)
        out.append(holder)
    return out


class _Peer:
    """What the loop calls on either system: ``after_backward()`` after the backward,
    ``step()`` for the inner step, inside which a sync runs every ``sync_every`` steps,
    ``syncs()``, ``finish()`` after the last step and ``close()``."""

    inner: torch.optim.Optimizer
    sync_every: int

    def __enter__(self) -> _Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def step(self) -> None:
        self.inner.step()

    def finish(self) -> None:
        pass


class _Torchft(_Peer):
    """torchft's DiLoCo around the inner optimizer, a ``Manager`` joined to the lighthouse:
    DiLoCo's post-step hook syncs (quorum, all-reduce, outer step) inside ``inner.step()``,
    the whole model every H steps, or with streaming fragments one fragment every ``H / F``
    steps, its all-reduce started ``fragment_sync_delay`` steps ahead. Nothing happens
    between syncs, nor after the run: it ends on a sync (steps are a multiple of H; with
    fragments, on the last fragment's, the others' H / F steps and more before)."""

    def __init__(self, spec: dict[str, Any], model: torch.nn.Module,
                 inner: torch.optim.Optimizer, sync: Any) -> None:
        from editrain.sync.ft import import_torchft
        from editrain.sync.outer import resolve_optimizer_class

        torchft = import_torchft()
        DiLoCo = import_torchft("torchft.local_sgd").DiLoCo
        h = sync.local_sgd_sync_interval
        fragments, delay, alpha = check_streaming(spec, h)
        self.sync_every = h // fragments
        timeout = timedelta(seconds=float(spec["timeout_s"]))
        outer_cls = resolve_optimizer_class(sync.outer_optim_class)
        parts = model_fragments(model, fragments, sync.split_root)
        outers = [outer_cls(part.parameters(), **(sync.outer_optim_kwargs or {}))
                  for part in parts]
        address = str(spec.get("address") or "localhost")
        # Kept for the whole run: the store's server lives as long as this object does
        # (it listens on every interface; ``address`` is where the others reach it).
        self.store = store = torch.distributed.TCPStore(address, 0, is_master=True,
                                                        wait_for_workers=False)
        self.manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=timeout),
            load_state_dict=lambda sd: model.load_state_dict(sd["model"]),
            state_dict=lambda: {"model": model.state_dict()},
            min_replica_size=int(spec["replicas"]), use_async_quorum=False, init_sync=False,
            replica_id=f"editrain_peer_{spec['replica']}", store_addr=address,
            store_port=store.port, rank=0, world_size=1, lighthouse_addr=spec["lighthouse"],
            hostname=address, timeout=timeout, quorum_timeout=timeout,
            connect_timeout=timeout,
        )
        self.inner = inner
        self.diloco = DiLoCo(self.manager, parts, inner, outers if fragments > 1 else outers[0],
                             sync_every=h, backup_device=torch.device("cpu"),
                             pin_memory=False, fragment_sync_delay=delay,
                             fragment_update_alpha=alpha)

    def __enter__(self) -> _Torchft:
        self.diloco.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.diloco.__exit__(*exc)

    def syncs(self) -> int:
        return int(self.manager.current_step())

    def close(self) -> None:
        self.manager.shutdown(wait=False)


class _Library(_Peer):
    """editrain's ``diloco`` through its public API (``editrain.edit``), as a library user
    writes it: ``engine.after_backward()``, then ``engine.step()`` after the inner step
    (a sync every H steps); ``engine.finish()`` at the end puts every replica on the
    global model (nothing to do after a sync)."""

    def __init__(self, model: torch.nn.Module, info: Any, inner: torch.optim.Optimizer,
                 sync: Any) -> None:
        from editrain.api import edit

        self.inner = inner
        self.engine = edit(model, info, sync)
        self.sync_every = int(sync.resolve().local_sgd_sync_interval)

    def after_backward(self) -> None:
        self.engine.after_backward()

    def step(self) -> None:
        self.inner.step()
        self.engine.step()

    def syncs(self) -> int:
        return int(self.engine.num_syncs)

    def finish(self) -> None:
        self.engine.finish(force=True)

    def close(self) -> None:
        self.engine.close()
        torch.distributed.destroy_process_group()


def method_name(system: str, streaming: dict[str, Any]) -> str:
    """The method name a run's summary records: ``torchft-streaming-diloco`` when torchft
    syncs in fragments or with a delay, else the system's name in :data:`SYSTEMS`."""
    if system == "torchft" and (streaming.get("fragments", 1) > 1
                                or streaming.get("fragment_sync_delay", 0) > 0):
        return "torchft-streaming-diloco"
    return SYSTEMS[system]


def _checked_streaming(spec: dict[str, Any], system: str, h: int) -> dict[str, Any]:
    """The streaming options the summary records: torchft's, checked and completed; the
    library's system takes none."""
    streaming = {k: spec[k] for k in STREAMING_KEYS if k in spec}
    if system == "torchft":
        return dict(zip(STREAMING_KEYS, check_streaming(spec, h), strict=True))
    if streaming:
        raise ValueError(f"{', '.join(streaming)}: torchft's streaming DiLoCo options; "
                         f"system {system!r} takes none")
    return streaming


def train_replica(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one replica group with the spec's system (see the module docstring), write
    its logs and return its result (also written to ``replica{R}.json``)."""
    import editrain
    from editrain.config import load_config, model_config
    from editrain.corpus import prepare_data
    from editrain.data import SequenceStream, eval_batches
    from editrain.malloc import keep_freed_memory
    from editrain.models import Llama, causal_lm_loss
    from editrain.optim import build_optimizer
    from editrain.optim.schedule import lr_at

    system = spec.get("system", "torchft")
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; allowed: {', '.join(SYSTEMS)}")
    cfg = load_config(None, spec["options"])
    replica, replicas = int(spec["replica"]), int(spec["replicas"])
    run_dir = Path(spec["run_dir"])
    torch.set_num_threads(int(spec["threads"]))
    t, sync = cfg.train, cfg.sync.resolve()
    if t.steps % sync.local_sgd_sync_interval:
        raise ValueError(f"train.steps ({t.steps}) must be a multiple of H "
                         f"({sync.local_sgd_sync_interval}) so that the run ends on a sync")
    streaming = _checked_streaming(spec, system, sync.local_sgd_sync_interval)
    info = None
    if system == "library":
        # What a user's process does first; it also sets malloc up (keep_freed_memory).
        info = editrain.init_mesh(shard_size=1, backend="gloo", device_type="cpu",
                                  timeout_s=float(spec["timeout_s"]))
    else:
        keep_freed_memory()  # the process set up as editrain's workers are (run_worker)

    data = prepare_data(cfg)
    stream = SequenceStream(data.train, t.seq_len, replica, replicas, t.seed)
    val = eval_batches(data.val, t.seq_len, t.batch_size, 0, 1, t.final_eval_tokens)
    model = Llama(model_config(cfg, vocab_size=data.vocab_size), seed=t.seed)
    if info is not None:
        editrain.parallelize(model, info)  # one-process replicas: the model stays as it is
    inner = build_optimizer(cfg.optim.name, model.parameters(), lr=t.lr,
                            betas=(t.beta1, t.beta2), weight_decay=t.weight_decay)
    peer = (_Library(model, info, inner, cfg.sync) if info is not None
            else _Torchft(spec, model, inner, sync))
    rank_log = RankLog(run_dir, replica)
    metrics = MetricsWriter(run_dir, enabled=replica == 0, trackers=[])  # replica 0 logs
    accumulate = t.gradient_accumulation_steps
    per_step = t.batch_size * t.seq_len * accumulate
    initial = evaluate(model, val)
    metrics.write({"step": 0, "tokens": 0, **initial, "wall_time_s": 0.0})
    start = time.perf_counter()
    try:
        with peer:
            for step in range(1, t.steps + 1):
                t0 = time.perf_counter()
                for group in inner.param_groups:
                    group["lr"] = lr_at(step - 1, cfg)
                total = 0.0
                inner.zero_grad(set_to_none=True)
                for _ in range(accumulate):
                    x = stream.next_batch(t.batch_size)
                    loss = causal_lm_loss(model(x[:, :-1]), x[:, 1:])
                    (loss / accumulate).backward()
                    total += float(loss) / accumulate
                peer.after_backward()
                if t.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
                syncs_before = peer.syncs()
                t1 = time.perf_counter()
                peer.step()  # every H steps the sync runs inside this call
                opt_s = time.perf_counter() - t1
                synced = step % peer.sync_every == 0
                step_time = time.perf_counter() - t0
                sync_s = opt_s if synced else 0.0
                times = {"wall_time_s": time.perf_counter() - start, "step_time_s": step_time,
                         "compute_s": step_time - sync_s}
                rank_log.write({"rank": replica, "replica": replica, "shard": 0, "step": step,
                                "tokens": step * per_step, **times, "sync_wait_s": sync_s,
                                "grad_sync_s": 0.0})
                row: dict[str, Any] = {"step": step, "tokens": step * per_step * replicas,
                                       "loss": total, "lr": lr_at(step - 1, cfg), **times}
                if synced:
                    # Blocking: (quorum,) all-reduce of the pseudo-gradients, outer step.
                    row["sync"] = {"step": step, "sync": syncs_before, "wait_s": sync_s,
                                   "sync_time_s": sync_s,
                                   "committed": peer.syncs() > syncs_before}
                metrics.write(row)
        train_s = time.perf_counter() - start
        peer.finish()
        final = evaluate(model, val)  # after the last sync: the global model
        metrics.write({"step": t.steps, "tokens": t.steps * per_step * replicas, **final,
                       "wall_time_s": time.perf_counter() - start})
    finally:
        rank_log.close()
        metrics.close()
    result = {"replica": replica, "initial_val_loss": initial["val_loss"],
              "final_val_loss": final["val_loss"], "val_tokens": final["val_tokens"],
              "num_syncs": peer.syncs(), "train_time_s": train_s, "steps": t.steps}
    summary = {"steps": t.steps, "tokens": t.steps * per_step * replicas,
               "final_val_loss": final["val_loss"], "val_tokens": final["val_tokens"],
               "wall_time_s": time.perf_counter() - start, "train_time_s": train_s,
               "num_syncs": peer.syncs(), "method": method_name(system, streaming),
               "replicas": replicas, "shard_size": 1, **streaming}
    (run_dir / f"replica{replica}.json").write_text(to_json(result, indent=1))
    if replica == 0:
        (run_dir / "summary.json").write_text(to_json(summary, indent=1))
    peer.close()
    return result


def spec_from_args(args: argparse.Namespace, train_options: list[str]) -> dict[str, Any]:
    """The worker's spec from its command line (see :func:`main`), every option checked
    before any work; ``threads`` defaults to what an editrain worker alone on this
    machine takes (``editrain.runtime.worker_threads``).

    Raises:
        ConfigError / ValueError: a bad training or streaming option (one line naming it).
    """
    from editrain.config import load_config
    from editrain.config.overrides import parse_overrides
    from editrain.runtime import worker_threads

    options, rest = parse_overrides(train_options)
    if rest:
        raise ValueError(f"unexpected argument(s) {' '.join(rest)}; training options look "
                         "like --train.steps 60")
    cfg = load_config(None, options)
    spec = {"options": options, "system": "torchft", "replica": args.replica,
            "replicas": args.replicas, "lighthouse": args.lighthouse,
            "address": args.address, "run_dir": args.run_dir,
            "threads": args.threads or worker_threads(cfg, 1), "timeout_s": args.timeout_s,
            "fragments": args.fragments, "fragment_sync_delay": args.delay,
            "fragment_update_alpha": args.alpha}
    check_streaming(spec, cfg.sync.resolve().local_sgd_sync_interval)
    return spec


def serve_lighthouse(bind: str, replicas: int) -> None:
    """Serve a torchft lighthouse at ``bind`` (``HOST:PORT``) until killed; prints
    ``lighthouse ready at ADDRESS`` once it listens.

    A quorum needs every replica (``replicas``). The heartbeat timeout is a minute: a
    replica's heartbeats may queue behind its all-reduce on a slow link, and the runs here
    have no failures to detect.
    """
    from editrain.sync.ft import import_torchft

    lighthouse = import_torchft("torchft.coordination").LighthouseServer
    server = lighthouse(bind=bind, min_replicas=replicas, join_timeout_ms=100,
                        heartbeat_timeout_ms=60_000)
    print(f"lighthouse ready at {server.address()}", flush=True)
    while True:
        time.sleep(60)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``--spec SPEC.json``, the spec's fields as options with the
    training options after ``--``, or ``--serve-lighthouse HOST:PORT``; returns 0 once the
    replica trained and wrote its logs."""
    parser = CommandParser(description="one torchft DiLoCo replica group on "
                                                 "editrain's model and data")
    parser.add_argument("--spec", help="JSON file (see the module docstring)")
    parser.add_argument("--serve-lighthouse", metavar="HOST:PORT",
                        help="run a lighthouse there for --replicas replicas, until killed")
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--lighthouse", help="the lighthouse's address (http://HOST:PORT)")
    parser.add_argument("--address", default="localhost",
                        help="where the others reach this replica's store and manager")
    parser.add_argument("--run-dir")
    parser.add_argument("--fragments", type=int, default=1)
    parser.add_argument("--delay", type=int, default=0, help="fragment_sync_delay (steps)")
    parser.add_argument("--alpha", type=float, default=0.0, help="fragment_update_alpha")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads (0: as an editrain worker takes)")
    parser.add_argument("--timeout-s", type=float, default=600.0,
                        help="collective and quorum timeout")
    argv = list(sys.argv[1:] if argv is None else argv)
    train_options: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, train_options = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    # A run past its time limit gets SIGUSR1 first (peers._timed_out): every thread's stack
    # goes to this process's log, so a hang shows where it is.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if args.serve_lighthouse:
        serve_lighthouse(args.serve_lighthouse, args.replicas)
        return 0
    if args.spec:
        spec = json.loads(Path(args.spec).read_text())
    else:
        if not (args.lighthouse and args.run_dir and train_options):
            parser.error("without --spec: --lighthouse, --run-dir and the training options "
                         "after -- are required")
        spec = spec_from_args(args, train_options)
    train_replica(spec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
