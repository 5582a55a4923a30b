"""The Python examples of docs/api.md, run as written, on 4 gloo processes.

A user copies these blocks into a script; nothing else exercises their exact text, so an
API change that breaks one would otherwise go unnoticed. Each block runs verbatim (``exec``)
in a namespace holding only what the text says the user provides: ``MyLM`` (a small model
with its blocks in ``.layers``), ``batches``, ``loss_fn``, ``batch_for``, a built ``model``
for the tensor- and pipeline-parallel blocks, a checkpoint ``path``. Where the text says
"after building ... exactly as before", the building lines are those of the block that
built it the first time (its lines before its training loop).

Every claim a block makes in its comments and that a short run can see is checked: the
replicas end on one model, a saved DDP or DCP state resumes bitwise, the pipeline's last
stage returns the loss.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from editrain.spawn import run_ranks

ROOT = Path(__file__).resolve().parents[1]
API_DOC = ROOT / "docs" / "api.md"

MARKERS = {
    "loop": "with editrain.edit(model, info, config) as engine:",
    "reference": "local_sgd_config=editrain.LocalSGDConfig(",
    "ddp": "model = DistributedDataParallel(MyLM()",
    "ddp_state": 'opt.load_state_dict(state["opt"])',
    "tp": "editrain.init_mesh(shard_size=1, tp_size=2)",
    "pp": "editrain.init_mesh(shard_size=1, pp_size=2)",
    "dcp": "dcp.save(my_state(), checkpoint_id=path)",
}
"""One line that identifies each Python block of docs/api.md."""

LATER = "# ... later"
"""The comment that splits a save-and-load block into its save and its load."""


def python_blocks(text: str) -> list[str]:
    """The bodies of the text's ```python fences, in order, each after as many empty lines
    as precede it in the text: an error's traceback names its line of the document."""
    return ["\n" * text.count("\n", 0, m.start(1)) + m[1]
            for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M)]


def doc_blocks() -> dict[str, str]:
    """docs/api.md's Python blocks by name (:data:`MARKERS`); one block per marker."""
    blocks = python_blocks(API_DOC.read_text())
    named = {}
    for name, marker in MARKERS.items():
        found = [b for b in blocks if marker in b]
        assert len(found) == 1, f"{name}: {len(found)} blocks of docs/api.md contain {marker!r}"
        named[name] = found[0]
    return named


def lines_before(block: str, prefix: str) -> str:
    """The block's lines before its first line that starts with ``prefix`` (indentation
    aside): the building part of a block whose training loop starts there."""
    lines = block.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() and line.lstrip().startswith(prefix):
            return "".join(lines[:i])
    raise AssertionError(f"no line starts with {prefix!r} in:\n{block}")


def split_at_later(block: str) -> tuple[str, str]:
    """A save-and-load block's save (before :data:`LATER`) and load (from it on)."""
    save, later, load = block.partition(LATER)
    assert later, f"no {LATER!r} line in:\n{block}"
    return save, "\n" * save.count("\n") + later + load


# ----------------------------------------------------------------------------- what the user provides
VOCAB, DIM, SEQ = 32, 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.fc(h))


class MyLM(nn.Module):
    """The smallest language model with a list of blocks at ``.layers``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_batches(data_rank: int, steps: range, rows: int = 2, cols: int = SEQ + 1
                  ) -> list[torch.Tensor]:
    """Different tokens on every data rank and step."""
    return [torch.randint(VOCAB, (rows, cols),
                          generator=torch.Generator().manual_seed(1009 * data_rank + step))
            for step in steps]


def user_namespace(rank: int, **names: Any) -> dict[str, Any]:
    """What a block's script has defined before the block: the imports the text uses and
    the user's pieces."""
    import editrain

    return {"torch": torch, "editrain": editrain, "MyLM": MyLM, "loss_fn": loss_fn,
            "rank": rank, **names}


def run(code: str, namespace: dict[str, Any]) -> dict[str, Any]:
    exec(compile(code, str(API_DOC), "exec"), namespace)
    return namespace


def ddp_steps(ns: dict[str, Any], batches: list[torch.Tensor]) -> None:
    """The DDP block's loop body."""
    for x in batches:
        ns["loss_fn"](ns["model"](x[:, :-1]), x[:, 1:]).backward()
        ns["opt"].step()
        ns["opt"].zero_grad()


def fsdp_steps(ns: dict[str, Any], batches: list[torch.Tensor]) -> None:
    """The first block's loop body."""
    for x in batches:
        ns["loss_fn"](ns["model"](x[:, :-1]), x[:, 1:]).backward()
        ns["engine"].after_backward()
        ns["opt"].step()
        ns["opt"].zero_grad()
        ns["engine"].step()


def local_params(model: nn.Module) -> list[torch.Tensor]:
    """This rank's piece of every parameter (a DTensor's local shard)."""
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for p in model.parameters()]


# ----------------------------------------------------------------------------- the blocks
def ddp_example(rank: int, blocks: dict[str, str]) -> dict[str, Any]:
    """The DDP loop, then its save, 4 more steps; a rebuild, its load, the same 4 steps."""
    ns = run(blocks["ddp"], user_namespace(rank, batches=token_batches(rank, range(6))))
    save, load = split_at_later(blocks["ddp_state"])
    os.makedirs("ckpt", exist_ok=True)  # the user's directory
    run(save, ns)
    tail = token_batches(rank, range(6, 10))
    ddp_steps(ns, tail)
    continued = [p.detach().clone() for p in ns["model"].module.parameters()]
    syncs = ns["engine"].num_syncs
    ns["engine"].close()

    # "later, after building model, engine and opt exactly as before", in the same script
    run(lines_before(blocks["ddp"], "for x in batches:"), ns)
    run(load, ns)
    ddp_steps(ns, tail)
    resumed = [p.detach().clone() for p in ns["model"].module.parameters()]
    out = {"syncs": (syncs, ns["engine"].num_syncs),
           "bitwise": all(torch.equal(a, b) for a, b in zip(continued, resumed))}
    ns["engine"].close()
    return out


def reference_example(rank: int, blocks: dict[str, str]) -> dict[str, Any]:
    """The reference implementation's config classes, on the first block's model."""
    ns = run(lines_before(blocks["loop"], "config = "), user_namespace(rank))
    run(blocks["reference"], ns)
    fsdp_steps(ns, token_batches(rank, range(2)))
    config = ns["engine"].config
    out = {"in_warmup": ns["engine"].in_warmup, "method": config.method,
           "outer": (config.outer_optim_class, config.outer_optim_kwargs),
           "reducer": config.gta.reducer}
    ns["engine"].close()
    return out


def dcp_example(rank: int, blocks: dict[str, str], path: str) -> dict[str, Any]:
    """The first block's model and engine, 12 steps (a sync at 10), the DCP save, 4 more
    steps; a rebuild, the DCP load, the same 4 steps."""
    building = lines_before(blocks["loop"], "with editrain.edit(")
    engine_line = "engine = editrain.edit(model, info, config)\n"  # the block's, without `with`
    ns = run(building + engine_line, user_namespace(rank, path=path))
    fsdp_steps(ns, token_batches(rank, range(12)))
    save, load = split_at_later(blocks["dcp"])
    run(save, ns)
    tail = token_batches(rank, range(12, 16))
    fsdp_steps(ns, tail)
    continued = local_params(ns["model"])
    syncs = ns["engine"].num_syncs
    ns["engine"].close()

    run(building + engine_line, ns)  # "after building model, opt and engine exactly as before"
    run(load, ns)
    fsdp_steps(ns, tail)
    resumed = local_params(ns["model"])
    out = {"syncs": (syncs, ns["engine"].num_syncs),
           "bitwise": all(torch.equal(a, b) for a, b in zip(continued, resumed))}
    ns["engine"].close()
    return out


def tp_example(rank: int, blocks: dict[str, str]) -> dict[str, Any]:
    """The tensor-parallel block on editrain's Llama, then 3 steps and a final sync."""
    from editrain.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=VOCAB, dim=DIM, n_layers=2, n_heads=2, n_kv_heads=2,
                              ffn_hidden=32, max_seq_len=SEQ), seed=0)
    ns = run(blocks["tp"], user_namespace(
        rank, model=model, batch_for=lambda data_rank: token_batches(data_rank, range(1))[0]))
    ns["opt"] = torch.optim.AdamW(model.parameters(), lr=1e-2)
    fsdp_steps(ns, token_batches(ns["info"].topo.data_rank(rank), range(3)))
    ns["engine"].finish(force=True)
    out = {"data_rank": ns["info"].topo.data_rank(rank), "syncs": ns["engine"].num_syncs}
    ns["engine"].close()
    return out


def pp_example(rank: int, blocks: dict[str, str]) -> dict[str, Any]:
    """The pipeline-parallel block (one step) on editrain's Llama with untied embeddings."""
    from editrain.models import Llama, LlamaConfig

    model = Llama(LlamaConfig(vocab_size=VOCAB, dim=DIM, n_layers=2, n_heads=2, n_kv_heads=2,
                              ffn_hidden=32, max_seq_len=64, tie_embeddings=False), seed=0)
    ns = run(blocks["pp"], user_namespace(
        rank, model=model,
        batch_for=lambda data_rank: token_batches(data_rank, range(1), rows=8, cols=65)[0]))
    out = {"stage": ns["info"].stage, "loss": ns["loss"], "steps": ns["engine"].global_step}
    ns["engine"].close()
    return out


def loop_example(rank: int, blocks: dict[str, str], store: str) -> dict[str, Any]:
    """The first block, whole: it ends by destroying the default process group; the
    worker then joins a new one through the file ``store`` for :func:`run_ranks`' own end
    (a file, not a port picked when the test started: minutes later, another process of the
    suite had taken that port, EADDRINUSE)."""
    ns = run(blocks["loop"], user_namespace(rank, batches=token_batches(rank, range(12))))
    out = {"group_destroyed": not dist.is_initialized(), "closed": ns["engine"].closed,
           "syncs": ns["engine"].num_syncs, "shard": ns["info"].shard,
           "params": local_params(ns["model"])}
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=4)
    return out


def _worker(rank: int, world: int, workdir: str) -> dict[str, Any]:
    os.chdir(workdir)  # the DDP block writes ckpt/rank{rank}.pt where it runs
    blocks = doc_blocks()  # the loop block runs last: it ends the process group
    return {"ddp": ddp_example(rank, blocks),
            "reference": reference_example(rank, blocks),
            "dcp": dcp_example(rank, blocks, str(Path(workdir) / "dcp")),
            "tp": tp_example(rank, blocks),
            "pp": pp_example(rank, blocks),
            "loop": loop_example(rank, blocks, str(Path(workdir) / "rejoin.store"))}


# ----------------------------------------------------------------------------- the test
def test_every_python_block_of_the_api_doc_is_run():
    """A new block in docs/api.md needs a marker here (and a run in :func:`_worker`)."""
    blocks = python_blocks(API_DOC.read_text())
    assert len(blocks) == len(MARKERS) == len(set(doc_blocks().values())), blocks


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, 4, str(tmp_path_factory.mktemp("api-doc")))


def test_ddp_example_resumes_bitwise(results):
    for r in results:
        assert r["ddp"]["bitwise"], "the comment says: training continues bitwise identically"
        assert r["ddp"]["syncs"][0] == r["ddp"]["syncs"][1] >= 1


def test_reference_config_example_maps_the_reference_settings(results):
    for r in results:
        assert r["reference"] == {"in_warmup": True, "method": "edit",
                                  "outer": ("torch.optim.sgd.SGD",
                                            {"lr": 0.7, "momentum": 0.8, "nesterov": True}),
                                  "reducer": "gta"}


def test_dcp_example_resumes_bitwise(results):
    for r in results:
        assert r["dcp"]["bitwise"]
        assert r["dcp"]["syncs"][0] == r["dcp"]["syncs"][1] >= 1


def test_tensor_parallel_example_tp_peers_read_the_same_batch(results):
    assert [r["tp"]["data_rank"] for r in results] == [0, 0, 1, 1]
    assert all(r["tp"]["syncs"] >= 1 for r in results)


def test_pipeline_example_returns_the_last_stage_loss(results):
    for r in results:
        assert r["pp"]["steps"] == 1
        if r["pp"]["stage"] == 1:
            assert isinstance(r["pp"]["loss"], torch.Tensor) and r["pp"]["loss"].isfinite()
        else:
            assert r["pp"]["loss"] is None


def test_first_example_ends_every_replica_on_the_global_model(results):
    loops = [r["loop"] for r in results]
    assert all(loop["group_destroyed"] and loop["closed"] and loop["syncs"] >= 1
               for loop in loops)
    # ranks = replica * 2 + shard: ranks 0 and 2 hold shard 0 of the two replicas
    for a, b in ((loops[0], loops[2]), (loops[1], loops[3])):
        assert a["shard"] == b["shard"]
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
