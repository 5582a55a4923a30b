"""The loop of ``custom_loop.py`` with a Hugging Face ``LlamaForCausalLM`` built from a config.

Nothing in the loop changes: :func:`editrain.parallelize` and :func:`editrain.edit` find the
blocks at ``model.model.layers`` by themselves, and the logits are ``model(...).logits``.
The model is trained from scratch (``from_config``: no weights are downloaded). Needs
``pip install 'editrain[hf]'``.

    torchrun --nproc-per-node 4 examples/hf_llama.py
    torchrun --nproc-per-node 4 examples/hf_llama.py --tiny
"""

from __future__ import annotations

import torch
from custom_loop import VOCAB, parse_args, train  # examples/ is on sys.path when run
from transformers import LlamaConfig, LlamaForCausalLM

import editrain


def main() -> None:
    """Entry point of every rank (started by torchrun)."""
    args = parse_args()
    info = editrain.init_mesh(shard_size=args.shard_size)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=args.dim, intermediate_size=2 * args.dim,
        num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=args.seq_len, use_cache=False,
    )
    torch.manual_seed(0)  # the same initial weights on every rank
    model = LlamaForCausalLM(config).to(info.device)
    train(model, info, args, logits_of=lambda m, x: m(input_ids=x).logits)
    # EDiT: every rank waits for the others, then the default group goes, after the
    # engine's own groups (the engine closed them): no abort in gloo's teardown at exit.
    editrain.shutdown()


if __name__ == "__main__":
    main()
