"""EDiT with pipeline stages inside each replica: a ("sync", "pp", "shard", "tp") mesh.

Each replica holds its model in ``pp`` stages (editrain's Llama cut into contiguous runs of
blocks: the first stage also holds the embeddings, the last the final norm and the output
head), runs a ``torch.distributed.pipelining`` schedule (1F1B or GPipe) over microbatches,
and each stage syncs its own layers with the same stage of every other replica, layer by
layer in its own forward. What a replica decides (A-EDiT's clock, the start's check) is
agreed over all of its stages. 2 replicas x 2 stages:

    torchrun --nproc-per-node 4 examples/pipeline_parallel.py                  # CPU or GPUs
    torchrun --nproc-per-node 4 examples/pipeline_parallel.py --tiny           # seconds
    torchrun --nproc-per-node 8 examples/pipeline_parallel.py --pp-size 4      # 2 x 4 stages
    torchrun --nproc-per-node 8 examples/pipeline_parallel.py --shard-size 2   # FSDP2 in each
"""

from __future__ import annotations

import argparse

import torch
from custom_loop import VOCAB, markov_batch, parse_args  # examples/ is on sys.path

import editrain
from editrain.models import Llama, LlamaConfig
from editrain.pipeline import LlamaStage, PipelineRunner


def train(info: editrain.MeshInfo, args: argparse.Namespace, microbatches: int,
          schedule: str) -> None:
    """A plain loop over a pipeline; the EDiT lines are marked. The last stage of replica 0
    prints the global model's held-out loss."""
    config = LlamaConfig(vocab_size=VOCAB, dim=args.dim, n_layers=args.layers, n_heads=4,
                         n_kv_heads=2, ffn_hidden=4 * args.dim, max_seq_len=args.seq_len,
                         tie_embeddings=False)  # the first and last stage hold their own
    model = Llama(config, seed=0).to(info.device)  # the same initial weights on every rank
    stage = LlamaStage(model, info.stage, info.topo.pp_size)  # this rank's part of it
    del model
    editrain.parallelize(stage, info)  # EDiT: FSDP2 over the stage's "shard" ranks
    engine = editrain.edit(stage, info, editrain.SyncConfig(  # EDiT: this stage's units
        method=args.method, local_sgd_sync_interval=args.sync_interval,
        local_sgd_warmup_steps=args.warmup))
    opt = torch.optim.AdamW(stage.parameters(), lr=args.lr)
    runner = PipelineRunner(stage, batch_size=args.batch_size, seq_len=args.seq_len - 1,
                            n_microbatches=microbatches, schedule=schedule,
                            group=info.pp_mesh.get_group())
    data_rank = info.topo.data_rank(info.rank)  # EDiT: the stages of a replica read alike
    seq, bs = args.seq_len, args.batch_size
    reports = info.replica == 0 and runner.is_last and info.shard == 0

    def held_out_loss() -> float | None:
        x = markov_batch(10**6, info.shard, bs, seq, info.device)  # same on every replica
        loss = runner.eval_loss(x[:, :-1], x[:, 1:])
        return None if loss is None else float(loss)

    with engine:
        first = held_out_loss()
        for step in range(args.steps):
            x = markov_batch(step, data_rank, bs, seq, info.device)
            loss = runner.train_step(x[:, :-1], x[:, 1:])  # forward + backward, microbatched
            engine.after_backward()  # EDiT: warm-up gradient averaging across replicas
            opt.step()
            opt.zero_grad()
            engine.step()  # EDiT: counts the step, arms the layer-wise sync of this stage
            if reports and (step % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {float(loss):.4f}  syncs {engine.num_syncs}",
                      flush=True)
        engine.finish(force=True)  # EDiT: every replica ends on the global model
        last = held_out_loss()
    if reports:
        print(f"held-out loss {first:.4f} -> {last:.4f} after {engine.num_syncs} syncs",
              flush=True)
    engine.close()  # EDiT: stops its thread, destroys its own process groups


def main() -> None:
    """Entry point of every rank (started by torchrun)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--pp-size", type=int, default=2, help="pipeline stages per replica")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per batch")
    p.add_argument("--schedule", default="1f1b", help="1f1b or gpipe")
    own, rest = p.parse_known_args()
    args = parse_args(["--shard-size", "1", *rest])
    # EDiT: the ("sync", "pp", "shard", "tp") mesh
    info = editrain.init_mesh(shard_size=args.shard_size, pp_size=own.pp_size)
    train(info, args, own.microbatches, own.schedule)
    # EDiT: every rank waits for the others, then the default group goes, after the
    # engine's own groups (the engine closed them): no abort in gloo's teardown at exit.
    editrain.shutdown()


if __name__ == "__main__":
    main()
