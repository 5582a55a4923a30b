"""EDiT on a ``DistributedDataParallel`` model: the loop of the EDiT reference's DDP mode.

The model of ``custom_loop.py`` is not sharded: every rank holds a full copy, and DDP
averages the gradients within each replica (over the replica's own group, never the world,
so the replicas really train apart). ``StatefulPostLocalSGDOptimizer`` wraps the inner
optimizer like the reference's wrapper: its ``step()`` also runs the engine's book-keeping,
its ``state_dict()`` also holds the engine's state. Each of a replica's ranks syncs half of
every unit across replicas and the replica all-gathers the result, so a replica sends one
model's worth of bytes per sync, not one per rank. 2 replicas x 2 ranks:

    torchrun --nproc-per-node 4 examples/ddp.py              # CPU (gloo) or GPUs (nccl)
    torchrun --nproc-per-node 4 examples/ddp.py --tiny       # a few seconds
    torchrun --nproc-per-node 4 examples/ddp.py --tiny --save ckpt/   # plus a state per rank
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from custom_loop import VOCAB, TinyLM, markov_batch, parse_args  # examples/ is on sys.path
from torch.nn.parallel import DistributedDataParallel

import editrain


def train(info: editrain.MeshInfo, args: argparse.Namespace) -> None:
    """A plain DDP loop; the EDiT lines are marked. Prints the global model's held-out loss."""
    torch.manual_seed(0)  # the same initial weights on every rank
    net = TinyLM(VOCAB, args.dim, args.layers, heads=4, seq_len=args.seq_len).to(info.device)
    # EDiT: DDP over the replica's ranks only (the "shard" dimension of the mesh)
    model = DistributedDataParallel(net, process_group=info.shard_mesh.get_group())
    config = editrain.SyncConfig(method=args.method, local_sgd_sync_interval=args.sync_interval,
                                 local_sgd_warmup_steps=args.warmup)
    engine = editrain.edit(model, info, config)  # EDiT: finds the blocks inside the wrapper
    opt = editrain.StatefulPostLocalSGDOptimizer(  # EDiT: the inner optimizer, wrapped
        torch.optim.AdamW(model.parameters(), lr=args.lr), engine)
    seq, bs = args.seq_len, args.batch_size

    def loss_on(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

    held_out = markov_batch(10**6, info.shard, bs, seq, info.device)  # same on every replica
    with engine:
        with torch.no_grad():
            first = float(loss_on(held_out))
        for step in range(args.steps):
            loss = loss_on(markov_batch(step, info.rank, bs, seq, info.device))
            loss.backward()
            opt.step()  # EDiT: warm-up gradient averaging, inner step, engine.step()
            opt.zero_grad()
            if info.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss.item():.4f}  syncs {engine.num_syncs}",
                      flush=True)
        engine.finish(force=True)  # EDiT: every replica ends on the global model
        with torch.no_grad():
            last = float(loss_on(held_out))
        if args.save:
            # Every rank takes part (the engine gathers over the replica) and saves its own.
            state = {"model": net.state_dict(), "opt": opt.state_dict()}
            Path(args.save).mkdir(parents=True, exist_ok=True)
            torch.save(state, Path(args.save) / f"rank{info.rank}.pt")
        if info.rank == 0:
            print(f"held-out loss {first:.4f} -> {last:.4f} after {engine.num_syncs} syncs",
                  flush=True)
    engine.close()  # EDiT: stops its thread, destroys its own process groups


def main() -> None:
    """Entry point of every rank (started by torchrun)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--save", default="", help="directory for each rank's model + optimizer state")
    own, rest = p.parse_known_args()
    args = parse_args(rest)
    args.save = own.save
    info = editrain.init_mesh(shard_size=args.shard_size)  # EDiT: ("sync", "shard") mesh
    train(info, args)
    # EDiT: every rank waits for the others, then the default group goes, after the
    # engine's own groups (the engine closed them): no abort in gloo's teardown at exit.
    editrain.shutdown()


if __name__ == "__main__":
    main()
