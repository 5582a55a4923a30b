"""Process setup of one worker: signals, threads, glibc malloc, logging, device and mesh.

A worker calls :func:`setup_process` first thing (its process dies with its parent, Ctrl-C
ends it quietly, intra-op threads and malloc are set), then :func:`init_distributed` for
its device and process groups. Seeding is not global: the model is built from
``train.seed`` and the data order, the engine and the simulated stalls each draw from
their own seeded generators.
"""

from __future__ import annotations

import logging
import multiprocessing
from typing import Any

import torch

from editrain.malloc import keep_freed_memory
from editrain.spawn import worker_threads
from editrain.topology import MeshInfo, init_default_group, init_mesh


def setup_process(cfg: Any) -> None:
    """Set up a worker process: it dies with the process that started it (also one killed
    with SIGKILL), ends quietly on SIGINT, runs :func:`~editrain.spawn.worker_threads` intra-op threads,
    keeps freed memory (:func:`keep_freed_memory`) and logs warnings as bare lines.

    Args:
        cfg: the run's configuration (``dist.threads_per_proc``).
    """
    from editrain.spawn import die_with_parent, sigint_ends_quietly

    die_with_parent()
    sigint_ends_quietly()
    torch.set_num_threads(worker_threads(cfg))
    keep_freed_memory()
    # A worker of editrain's launcher starts with its own logging (a process forked from
    # one with handlers would keep them); under torchrun the worker is the command itself
    # and keeps what it set up.
    logging.basicConfig(level=logging.WARNING, format="%(message)s",
                        force=multiprocessing.parent_process() is not None)


def init_distributed(cfg: Any, run_dir: Any) -> MeshInfo:
    """The default process group and the mesh of ``cfg.dist`` (``device`` and ``backend``
    ``"auto"``: chosen from the hardware; see :func:`editrain.topology.init_mesh`).

    Between the two, every rank checks it runs rank 0's options in rank 0's run directory
    (:func:`check_ranks_agree`): the mesh's groups are made by every rank in the same order,
    so nodes given another ``dist.shard_size``, ``tp_size`` or ``pp_size`` would hang there,
    before any later check is reached.
    """
    d = cfg.dist
    backend = None if d.backend == "auto" else d.backend
    device_type = None if d.device == "auto" else d.device
    init_default_group(backend, device_type)
    check_ranks_agree(cfg, run_dir)
    return init_mesh(d.shard_size, backend=backend, device_type=device_type,
                     tp_size=d.tp_size, pp_size=d.pp_size)


PER_NODE_OPTIONS = frozenset({"quiet", "run_dir", "resume", "data.cache_dir", "dist.nproc",
                              "dist.threads_per_proc", "dist.ft_lighthouse",
                              "model.init_from", "model.hf_config", "data.tokenizer"})
"""Options that may differ between the nodes of one job: the output, paths (the run
directory's mount path, the directory itself must be the same: :func:`check_ranks_agree`;
a model or tokenizer of the hub cache resolves to each node's own cache), a node-local
token cache, the local launcher's process count and threads, the lighthouse's address as
each node reaches it."""


NODE_PATH_OPTIONS = ("model.init_from", "model.hf_config", "data.tokenizer")
"""Per-node options naming files the model is built from: their paths may differ (each
node's own hub cache), what the paths hold is compared (:func:`input_digest`)."""

SAMPLED_BYTES = 1 << 20
"""How much of each end of a weight file :func:`input_digest` reads: a safetensors file's
header (names, shapes, offsets) is at its start and its first tensors after it, so another
revision or fine-tune of the same model differs there, and the digest reads 2 MiB per file
whatever the model's size."""

_DIGESTED = ("config.json", "generation_config.json", "tokenizer.json",
             "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
             "model.safetensors.index.json")


def input_digest(path: Any) -> str | None:
    """A digest of what a model or tokenizer path holds (None for no path, the value
    itself for one that is no file or directory here): the whole of a small file (a
    config, a tokenizer), and each ``*.safetensors`` file's size and both ends
    (:data:`SAMPLED_BYTES`)."""
    from pathlib import Path

    if not isinstance(path, str) or not path:
        return None
    here = Path(path)
    try:  # an error here would leave the other ranks waiting in the gather: it is compared
        return _digest_files(here)
    except OSError as e:
        return f"unreadable: {path}: {e.strerror or e}"


def _digest_files(here: Any) -> str:
    """:func:`input_digest` of an existing or missing path (raises OSError)."""
    import hashlib

    if here.is_dir():
        files = [here / n for n in _DIGESTED] + sorted(here.glob("*.safetensors"))
    elif here.is_file():
        files = [here]
    else:
        return f"not here: {here}"
    digest = hashlib.sha256()
    for file in files:
        if not file.is_file():
            continue
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}:".encode())
        with open(file, "rb") as f:
            if file.suffix != ".safetensors" or size <= 2 * SAMPLED_BYTES:
                digest.update(f.read())
            else:
                digest.update(f.read(SAMPLED_BYTES))
                f.seek(size - SAMPLED_BYTES)
                digest.update(f.read())
    return digest.hexdigest()


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        else:
            out[name] = value
    return out


def comparable_options(cfg: Any) -> dict[str, Any]:
    """``cfg``'s options that every rank of a job must share (flat names), i.e. all but
    :data:`PER_NODE_OPTIONS`."""
    from editrain.config import to_dict

    return {k: v for k, v in _flat(to_dict(cfg)).items() if k not in PER_NODE_OPTIONS}


def refuse_other_options(rank: int, theirs: dict[str, Any], first: dict[str, Any]) -> None:
    """Raise ConfigError naming the options (up to three, both values) where rank
    ``rank``'s (``theirs``, :func:`comparable_options`) differ from rank 0's (``first``)."""
    from editrain.errors import ConfigError, spelled

    differ = sorted(k for k in first.keys() | theirs.keys() if first.get(k) != theirs.get(k))
    if differ:
        named = "; ".join(f"{k} = {spelled(theirs.get(k))} (rank 0: {spelled(first.get(k))})"
                          for k in differ[:3])
        more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
        raise ConfigError(f"rank {rank} was given other options than rank 0: {named}"
                          f"{more}; every node of a job must run the same ones")


def check_ranks_agree(cfg: Any, run_dir: Any) -> None:
    """Every rank of the job runs the same options and sees the same run directory (a
    collective: every rank calls it once its process group is up).

    Under torchrun each node is started with its own command line: one given other options
    hung at its first differing collective (``--steps``) or trained another model than the
    rest without a word (``--train.lr``); one whose run directory is not on storage every
    node sees failed at its first checkpoint, leaving one marked complete without its
    files. Ranks started by editrain's own launcher agree by construction; the check costs
    one small gather.

    Raises:
        ConfigError: options that differ from rank 0's (up to three named, with both
            values), outside :data:`PER_NODE_OPTIONS`.
        RunDirError: a rank that does not see rank 0's run directory.
    """
    import torch.distributed as dist

    from editrain.config import to_dict
    from editrain.errors import ConfigError, RunDirError
    from editrain.paths import shown
    from editrain.rundir import read_record

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    flat = _flat(to_dict(cfg))
    record = read_record(run_dir)
    mine = {"options": comparable_options(cfg), "run": record.run_id if record else None,
            "reads": {k: (flat.get(k), input_digest(flat.get(k)))
                      for k in NODE_PATH_OPTIONS}}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    first = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        refuse_other_options(rank, theirs["options"], first["options"])
        differ = [k for k in NODE_PATH_OPTIONS
                  if theirs["reads"][k][1] != first["reads"][k][1]]
        if differ:
            option = differ[0]
            there, here = (shown(str(r["reads"][option][0])) for r in (theirs, first))
            raise ConfigError(
                f"rank {rank} reads other files than rank 0 for {option} (there "
                f"{there}, rank 0: {here}): its "
                f"path may differ between nodes, what it holds may not (another revision "
                f"of a hub model, a tokenizer or weights changed on one node)")
        if theirs["run"] != first["run"]:
            raise RunDirError(f"rank {rank} does not see the run directory rank 0 claimed "
                              f"({shown(run_dir)}: run {first['run']}, there {theirs['run']}): it "
                              f"must be on storage every node sees, at the same path")
