"""Your own model and training loop with EDiT: the lines marked ``# EDiT`` are all it adds.

A plain ``nn.Module`` language model learns a synthetic Markov-chain "language" on 2
replicas x 2 shards: FSDP2 shards each replica over its 2 ranks, EDiT keeps the replicas
apart for ``--sync-interval`` steps and then syncs them layer by layer during the forward.

    torchrun --nproc-per-node 4 examples/custom_loop.py              # CPU (gloo) or GPUs (nccl)
    torchrun --nproc-per-node 4 examples/custom_loop.py --tiny       # a few seconds
    torchrun --nproc-per-node 4 examples/custom_loop.py --method diloco
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import editrain

VOCAB = 64


# ----------------------------------------------------------------------------- the model
class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP (x: [B, T, D])."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """Embedding, a list of blocks in ``self.layers`` (EDiT's sync units), LM head."""

    def __init__(self, vocab: int, dim: int, n_layers: int, heads: int, seq_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq_len, dim))
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(n_layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))  # logits [B, T, V]


# ----------------------------------------------------------------------------- the data
def markov_batch(step: int, rank: int, batch: int, seq_len: int,
                 device: torch.device) -> torch.Tensor:
    """Token sequences [B, T] from a fixed random Markov chain; different on every rank."""
    table = torch.softmax(3 * torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)),
                          dim=-1)  # the same "language" everywhere
    gen = torch.Generator().manual_seed(1_000_003 * rank + step)
    x = torch.empty(batch, seq_len, dtype=torch.long)
    x[:, 0] = torch.randint(VOCAB, (batch,), generator=gen)
    for t in range(1, seq_len):
        x[:, t] = torch.multinomial(table[x[:, t - 1]], 1, generator=gen).squeeze(1)
    return x.to(device)


# ----------------------------------------------------------------------------- the loop
def train(model: nn.Module, info: editrain.MeshInfo, args: argparse.Namespace,
          logits_of: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> None:
    """An ordinary FSDP2 loop plus EDiT; prints the loss of the global model at the end."""
    editrain.parallelize(model, info)  # EDiT: FSDP2, one unit per block + the root
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    config = editrain.SyncConfig(method=args.method, local_sgd_sync_interval=args.sync_interval,
                                 local_sgd_warmup_steps=args.warmup)
    seq, bs = args.seq_len, args.batch_size

    def loss_on(x: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits_of(model, x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())

    held_out = markov_batch(10**6, info.shard, bs, seq, info.device)  # same on every replica
    with editrain.edit(model, info, config) as engine:  # EDiT
        with torch.no_grad():
            first = float(loss_on(held_out))
        for step in range(args.steps):
            loss = loss_on(markov_batch(step, info.rank, bs, seq, info.device))
            loss.backward()
            engine.after_backward()  # EDiT: averages gradients only during warm-up
            opt.step()
            opt.zero_grad()
            engine.step()  # EDiT: counts steps, arms the next sync
            if info.rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {loss.item():.4f}  syncs {engine.num_syncs}",
                      flush=True)
        engine.finish(force=True)  # EDiT: every replica ends on the global model
        with torch.no_grad():
            last = float(loss_on(held_out))
        if info.rank == 0:
            print(f"held-out loss {first:.4f} -> {last:.4f} after {engine.num_syncs} syncs",
                  flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options shared by the examples."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="edit", help="sync, post_local_sgd, diloco, edit, aedit")
    p.add_argument("--shard-size", type=int, default=2, help="ranks per replica")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync-interval", type=int, default=10, help="H: inner steps per sync")
    p.add_argument("--warmup", type=int, default=10, help="synchronous steps first")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="tiny model, 14 steps (tests)")
    args = p.parse_args(argv)
    if args.tiny:
        # 4 synchronous steps, then a sync every 2: 5 syncs (the examples' tests ask for 4)
        args.steps, args.sync_interval, args.warmup, args.log_every = 14, 2, 4, 4
        args.batch_size, args.seq_len, args.dim, args.layers, args.lr = 8, 32, 32, 2, 1e-2
    return args


def main() -> None:
    """Entry point of every rank (started by torchrun)."""
    args = parse_args()
    info = editrain.init_mesh(shard_size=args.shard_size)  # EDiT: ("sync", "shard") mesh
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyLM(VOCAB, args.dim, args.layers, heads=4, seq_len=args.seq_len).to(info.device)
    train(model, info, args, logits_of=lambda m, x: m(x))
    # EDiT: every rank waits for the others, then the default group goes, after the
    # engine's own groups (the engine closed them): no abort in gloo's teardown at exit.
    editrain.shutdown()


if __name__ == "__main__":
    main()
