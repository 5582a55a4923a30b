"""EDiT with tensor parallelism inside each replica: a ("sync", "shard", "tp") mesh.

Each block of editrain's Llama is split Megatron-style over the ``tp`` ranks (column-wise
q/k/v and w1/w3, row-wise o and w2), FSDP2 shards what is left over ``shard``, and the
replicas sync across ``sync`` as usual: each rank syncs its own local pieces, and the
penalty's norms count the pieces tp peers hold alike (norms, embeddings) once. The tp peers
of a shard read the same batch. 2 replicas x 1 shard x 2 tp ranks:

    torchrun --nproc-per-node 4 examples/tensor_parallel.py                 # CPU or GPUs
    torchrun --nproc-per-node 4 examples/tensor_parallel.py --tiny          # a few seconds
    torchrun --nproc-per-node 8 examples/tensor_parallel.py --shard-size 2  # 2 x 2 x 2
"""

from __future__ import annotations

import argparse

import torch
from custom_loop import VOCAB, markov_batch, parse_args  # examples/ is on sys.path

import editrain
from editrain.models import Llama, LlamaConfig, causal_lm_loss


def train(info: editrain.MeshInfo, args: argparse.Namespace) -> None:
    """A plain loop; the EDiT lines are marked. Prints the global model's held-out loss."""
    config = LlamaConfig(vocab_size=VOCAB, dim=args.dim, n_layers=args.layers, n_heads=4,
                         n_kv_heads=2, ffn_hidden=4 * args.dim, max_seq_len=args.seq_len)
    model = Llama(config, seed=0).to(info.device)  # the same initial weights on every rank
    editrain.parallelize(model, info)  # EDiT: split over "tp", then FSDP2 over "shard"
    engine = editrain.edit(model, info, editrain.SyncConfig(
        method=args.method, local_sgd_sync_interval=args.sync_interval,
        local_sgd_warmup_steps=args.warmup))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data_rank = info.topo.data_rank(info.rank)  # EDiT: tp peers read the same batch
    seq, bs = args.seq_len, args.batch_size

    def loss_on(x: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(model(x[:, :-1]), x[:, 1:])

    held_out = markov_batch(10**6, info.shard, bs, seq, info.device)  # same on every replica
    with engine:
        with torch.no_grad():
            first = float(loss_on(held_out))
        for step in range(args.steps):
            loss = loss_on(markov_batch(step, data_rank, bs, seq, info.device))
            loss.backward()
            engine.after_backward()  # EDiT: warm-up gradient averaging across replicas
            opt.step()
            opt.zero_grad()
            engine.step()  # EDiT: counts the step, arms the layer-wise sync
            if info.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss.item():.4f}  syncs {engine.num_syncs}",
                      flush=True)
        engine.finish(force=True)  # EDiT: every replica ends on the global model
        with torch.no_grad():
            last = float(loss_on(held_out))
    if info.rank == 0:
        print(f"held-out loss {first:.4f} -> {last:.4f} after {engine.num_syncs} syncs",
              flush=True)
    engine.close()  # EDiT: stops its thread, destroys its own process groups


def main() -> None:
    """Entry point of every rank (started by torchrun)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--tp-size", type=int, default=2, help="tensor-parallel ranks per shard")
    own, rest = p.parse_known_args()
    args = parse_args(["--shard-size", "1", *rest])
    # EDiT: the ("sync", "shard", "tp") mesh
    info = editrain.init_mesh(shard_size=args.shard_size, tp_size=own.tp_size)
    train(info, args)
    # EDiT: every rank waits for the others, then the default group goes, after the
    # engine's own groups (the engine closed them): no abort in gloo's teardown at exit.
    editrain.shutdown()


if __name__ == "__main__":
    main()
