"""One peers worker: torchft's DiLoCo, or editrain's public API, on editrain's model and data.

``python -m editrain.bench.torchft_peer --spec SPEC.json`` trains replica ``replica`` of
``replicas`` in one process, in one training loop written once for both systems:

- ``system = "torchft"`` (the default): ``torchft.local_sgd.DiLoCo`` around a
  ``torchft.Manager`` (gloo through ``torchft.process_group.ProcessGroupGloo``), joined to
  the lighthouse at ``lighthouse``; the process is set up as editrain's workers are
  (``editrain.malloc.keep_freed_memory``).
- ``system = "library"``: editrain's ``diloco`` as a library user runs it:
  ``editrain.init_mesh(shard_size=1)`` (from the ``torchrun`` variables ``RANK``,
  ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), ``editrain.parallelize``,
  ``editrain.edit``, ``engine.after_backward()`` and ``engine.step()`` in this loop.

Everything else is editrain's, taken from the same configuration an ``editrain train`` run
of ``diloco`` would use: the ``Llama`` of the preset and seed, the token cache, the
replica's ``SequenceStream`` (rank = replica, world = replicas, the same seed), the inner
optimizer and learning-rate schedule, gradient clipping, H
(``sync.local_sgd_sync_interval``) and the outer optimizer of ``sync.resolve()``, with
``threads`` intra-op threads. The validation loss is computed over the same windows as
editrain's trainer (``editrain.data.eval_batches``), at the start and at the end.

The run directory gets what the bench reads from an editrain run: ``ranks/rank{R}.jsonl``
(every replica), and from replica 0 ``metrics.jsonl`` and ``summary.json``; each replica
also writes ``replica{R}.json`` with its own final numbers.

SPEC.json holds ``options`` (nested training options, as for ``load_config``),
``system``, ``replica``, ``replicas``, ``lighthouse`` (address; torchft only),
``run_dir``, ``threads`` and ``timeout_s`` (the collective and quorum timeout). torchft
only, optional: ``fragments`` (streaming DiLoCo's fragments, default 1: plain DiLoCo),
``fragment_sync_delay`` and ``fragment_update_alpha`` (default 0; see
:func:`check_streaming`), and ``address``, the address at which the other replicas and
the lighthouse reach this replica's store and manager (default ``localhost``: every
replica on one host).

Streaming DiLoCo's fragments are editrain's sync units (the root's parameters, every
block; ``sync.split_root`` as configured), fragment ``f`` holding every ``F``-th unit from
``f`` as editrain's ``sync.fragments`` does, each fragment with its own outer optimizer
(as each of editrain's units has). torchft syncs one fragment every ``H / F`` steps, the
fragment's all-reduce launched ``fragment_sync_delay`` steps before it is waited on.

Without ``--spec`` the worker takes its spec from the command line (what
``scripts/real_link.sh`` runs in each network namespace), the training options after
``--`` as ``editrain train`` takes them::

    python -m editrain.bench.torchft_peer --replica 0 --replicas 2 \
        --lighthouse http://10.77.0.1:29556 --address 10.77.0.1 --run-dir DIR \
        --fragments 2 --delay 1 -- --method edit --steps 60 ...

and ``--serve-lighthouse HOST:PORT --replicas N`` runs a lighthouse that serves there
until it is killed.
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

from editrain.metrics import MetricsWriter, RankLog, to_json


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[Any]) -> dict[str, float]:
    """Validation loss over ``batches`` (``EvalBatch`` list), weighted by targets, as
    editrain's trainer computes it.

    Args:
        model: the model.
        batches: the evaluation batches of ``editrain.data.eval_batches``.

    Returns:
        ``val_loss``, ``val_tokens`` and ``eval_time_s``.
    """
    from editrain.models import causal_lm_loss

    t0 = time.perf_counter()
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        x = batch.tokens
        loss = causal_lm_loss(model(x[:, :-1]), x[:, 1:])
        total[0] += loss.double() * batch.targets
        total[1] += batch.targets
    model.train()
    return {"val_loss": float(total[0] / total[1]), "val_tokens": int(total[1]),
            "eval_time_s": time.perf_counter() - t0}


def check_streaming(spec: dict[str, Any], h: int) -> tuple[int, int, float]:
    """The spec's streaming options, checked against H before any work.

    torchft syncs one fragment every ``H / F`` steps, so ``F`` must divide H, and a
    fragment's all-reduce must land before that fragment's next one: the delay is below
    ``H / F``.

    Args:
        spec: the worker's spec (``fragments``, ``fragment_sync_delay``,
            ``fragment_update_alpha``; absent: 1, 0, 0.0).
        h: ``sync.local_sgd_sync_interval``.

    Returns:
        ``(fragments, fragment_sync_delay, fragment_update_alpha)``.

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
    """The model's parameters as ``fragments`` modules for torchft, matching editrain's
    ``sync.fragments``: editrain's sync units (the root's parameters, then every unit
    module in order), fragment ``f`` holding every ``fragments``-th unit from ``f``.

    Args:
        model: editrain's ``Llama`` (``blocks()`` gives its transformer blocks).
        fragments: the number of fragments (1: the model itself).
        split_root: ``sync.split_root`` (embeddings and output head as units of their own).

    Returns:
        One module per fragment; its parameters are the model's own (shared, not copied).
    """
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


class _Torchft:
    """torchft's DiLoCo around the inner optimizer: a ``Manager`` joined to the lighthouse;
    ``inner.step()`` also syncs (quorum, all-reduce, outer step): the whole model every H
    steps, or with streaming fragments one fragment every ``H / F`` steps, its all-reduce
    started ``fragment_sync_delay`` steps ahead."""

    def __init__(self, spec: dict[str, Any], model: torch.nn.Module,
                 inner: torch.optim.Optimizer, sync: Any) -> None:
        from editrain.sync.ft import import_torchft
        from editrain.sync.outer import resolve_optimizer_class

        torchft = import_torchft()
        Manager, ProcessGroupGloo = torchft.Manager, torchft.ProcessGroupGloo
        DiLoCo = import_torchft("torchft.local_sgd").DiLoCo

        h = sync.local_sgd_sync_interval
        fragments, delay, alpha = check_streaming(spec, h)
        self.sync_every = h // fragments
        timeout = timedelta(seconds=float(spec["timeout_s"]))
        outer_cls = resolve_optimizer_class(sync.outer_optim_class)
        parts = model_fragments(model, fragments, sync.split_root)
        # One outer optimizer per fragment, as editrain keeps one per unit.
        outers = [outer_cls(part.parameters(), **(sync.outer_optim_kwargs or {}))
                  for part in parts]
        address = str(spec.get("address") or "localhost")
        # Kept for the whole run: the store's server lives as long as this object does
        # (it listens on every interface; ``address`` is where the others reach it).
        self.store = store = torch.distributed.TCPStore(address, 0, is_master=True,
                                                        wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
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

    def after_backward(self) -> None:
        """Nothing: torchft's DiLoCo has no gradient work between syncs."""

    def step(self) -> None:
        """The inner step; DiLoCo's post-step hook syncs every H steps, inside it."""
        self.inner.step()

    def syncs(self) -> int:
        """Committed syncs so far."""
        return int(self.manager.current_step())

    def finish(self) -> None:
        """Nothing: the run ends on a sync (steps are a multiple of H; with fragments, the
        last fragment's, the others' H / F steps and more before)."""

    def close(self) -> None:
        """Leave the quorum."""
        self.manager.shutdown(wait=False)


class _Library:
    """editrain's ``diloco`` through its public API in this loop (``editrain.edit``), as a
    library user writes it: ``engine.after_backward()`` after the backward and
    ``engine.step()`` after the inner step, which syncs every H steps."""

    def __init__(self, model: torch.nn.Module, info: Any, inner: torch.optim.Optimizer,
                 sync: Any) -> None:
        from editrain.api import edit

        self.inner = inner
        self.engine = edit(model, info, sync)
        self.sync_every = int(sync.resolve().local_sgd_sync_interval)

    def __enter__(self) -> _Library:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def after_backward(self) -> None:
        """The engine's gradient work (none in the local phase)."""
        self.engine.after_backward()

    def step(self) -> None:
        """The inner step, then the engine's (a sync every H steps)."""
        self.inner.step()
        self.engine.step()

    def syncs(self) -> int:
        """Syncs so far."""
        return int(self.engine.num_syncs)

    def finish(self) -> None:
        """Every replica on the global model (nothing to do after a sync)."""
        self.engine.finish(force=True)

    def close(self) -> None:
        """The engine's thread and hooks, then the process group."""
        self.engine.close()
        torch.distributed.destroy_process_group()


SYSTEMS = {"torchft": "torchft-diloco", "library": "diloco-library"}
"""The worker's ``system`` values and the method name its summary records."""
STREAMING_KEYS = ("fragments", "fragment_sync_delay", "fragment_update_alpha")
"""The spec's streaming DiLoCo options (torchft only)."""


def method_name(system: str, streaming: dict[str, Any]) -> str:
    """The method name a run's summary records: ``torchft-streaming-diloco`` when torchft
    syncs in fragments or with a delay, else the system's name in :data:`SYSTEMS`."""
    if system == "torchft" and (streaming.get("fragments", 1) > 1
                                or streaming.get("fragment_sync_delay", 0) > 0):
        return "torchft-streaming-diloco"
    return SYSTEMS[system]


def train_replica(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one replica group, with torchft's DiLoCo or editrain's public API, and write
    its logs.

    Args:
        spec: see the module docstring.

    Returns:
        This replica's result (also written to ``replica{R}.json``).
    """
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
    streaming = {k: spec[k] for k in STREAMING_KEYS if k in spec}
    if system == "torchft":
        fragments, delay, alpha = check_streaming(spec, sync.local_sgd_sync_interval)
        streaming = {"fragments": fragments, "fragment_sync_delay": delay,
                     "fragment_update_alpha": alpha}
    elif streaming:
        raise ValueError(f"{', '.join(streaming)}: torchft's streaming DiLoCo options; "
                         f"system {system!r} takes none")
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
    per_step = t.batch_size * t.seq_len * t.gradient_accumulation_steps
    initial = evaluate(model, val)
    metrics.write({"step": 0, "tokens": 0, **initial, "wall_time_s": 0.0})
    start = time.perf_counter()
    try:
        with peer:
            for step in range(t.steps):
                t0 = time.perf_counter()
                for group in inner.param_groups:
                    group["lr"] = lr_at(step, cfg)
                total = 0.0
                inner.zero_grad(set_to_none=True)
                for _ in range(t.gradient_accumulation_steps):
                    x = stream.next_batch(t.batch_size)
                    loss = causal_lm_loss(model(x[:, :-1]), x[:, 1:])
                    (loss / t.gradient_accumulation_steps).backward()
                    total += float(loss) / t.gradient_accumulation_steps
                peer.after_backward()
                if t.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
                syncs_before = peer.syncs()
                t1 = time.perf_counter()
                peer.step()  # every H steps the sync runs inside this call
                opt_s = time.perf_counter() - t1
                synced = (step + 1) % peer.sync_every == 0
                step_time = time.perf_counter() - t0
                sync_s = opt_s if synced else 0.0
                wall = time.perf_counter() - start
                rank_log.write({"rank": replica, "replica": replica, "shard": 0,
                                "step": step + 1, "tokens": (step + 1) * per_step,
                                "wall_time_s": wall, "step_time_s": step_time,
                                "compute_s": step_time - sync_s, "sync_wait_s": sync_s,
                                "grad_sync_s": 0.0})
                row: dict[str, Any] = {
                    "step": step + 1, "tokens": (step + 1) * per_step * replicas,
                    "loss": total, "lr": lr_at(step, cfg), "wall_time_s": wall,
                    "step_time_s": step_time, "compute_s": step_time - sync_s}
                if synced:
                    # Blocking: (quorum,) all-reduce of the pseudo-gradients, outer step.
                    row["sync"] = {"step": step + 1, "sync": syncs_before,
                                   "wait_s": sync_s, "sync_time_s": sync_s,
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
    """The worker's spec from its command line (see the module docstring).

    Args:
        args: the parsed ``--replica``, ``--replicas``, ``--lighthouse``, ``--address``,
            ``--run-dir``, ``--fragments``, ``--delay``, ``--alpha``, ``--threads`` and
            ``--timeout-s``.
        train_options: ``editrain train``'s options (``--train.steps 60 ...``).

    Returns:
        The spec; ``threads`` defaults to what an editrain worker alone on this machine
        takes (``editrain.spawn.worker_threads``).

    Raises:
        ConfigError / ValueError: a bad training option, or a bad streaming option (one
            line naming it).
    """
    from editrain.config import load_config
    from editrain.config.overrides import parse_overrides
    from editrain.runtime import worker_threads

    options, rest = parse_overrides(train_options)
    if rest:
        raise ValueError(f"unexpected argument(s) {' '.join(rest)}; training options look "
                         "like --train.steps 60")
    cfg = load_config(None, options)  # every option checked before any work
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
    training options after ``--``, or ``--serve-lighthouse HOST:PORT``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status (0: trained and wrote its logs).
    """
    parser = argparse.ArgumentParser(description="one torchft DiLoCo replica group on "
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
    # A run past its time limit gets SIGUSR1 first (peers._wait): every thread's stack
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
