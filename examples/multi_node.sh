#!/usr/bin/env bash
# editrain across nodes with torchrun's c10d rendezvous: one replica per node (FSDP2 shards
# inside the node over its fast links, EDiT syncs the replicas across the slow network).
#
# Run the same command on every node, with MASTER_ADDR set to one node's reachable address:
#
#   NNODES=4 NPROC_PER_NODE=8 MASTER_ADDR=node0.example MASTER_PORT=29500 \
#       bash examples/multi_node.sh --config my.toml
#
# Every argument is passed on to `editrain train`. Single-node smoke test (2 replicas x 2
# shards on 4 local processes):
#
#   NNODES=1 NPROC_PER_NODE=4 SHARD_SIZE=2 bash examples/multi_node.sh --steps 20
#
# Variables (defaults in brackets):
#   NNODES          number of nodes [2]
#   NPROC_PER_NODE  processes per node, e.g. one per GPU [8]
#   SHARD_SIZE      ranks per replica [NPROC_PER_NODE: one replica per node]
#   MASTER_ADDR     the rendezvous host [required unless NNODES=1, then 127.0.0.1]
#   MASTER_PORT     the rendezvous port [29500]
#   RUN_ID          rendezvous id, the same on every node [editrain]
#   MAX_RESTARTS    restarts of all workers after a failure (torch elastic) [0]
#   PYTHON          the interpreter with editrain installed [python]
set -euo pipefail

NNODES=${NNODES:-2}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
SHARD_SIZE=${SHARD_SIZE:-$NPROC_PER_NODE}
if [ "$NNODES" = 1 ]; then
    MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
fi
: "${MASTER_ADDR:?set MASTER_ADDR to the address of one node (the rendezvous host)}"
MASTER_PORT=${MASTER_PORT:-29500}
RUN_ID=${RUN_ID:-editrain}
MAX_RESTARTS=${MAX_RESTARTS:-0}
PYTHON=${PYTHON:-python}

# c10d rendezvous: the first node to arrive hosts the store; ranks are assigned by torch.
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" \
    --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" \
    --rdzv-id "$RUN_ID" \
    --max-restarts "$MAX_RESTARTS" \
    -m editrain train --dist.shard_size "$SHARD_SIZE" "$@"
