#!/usr/bin/env bash
# GPU smoke test: training, syncs (plain, streaming int8, non-blocking A-EDiT, tensor
# parallelism on two or more GPUs, pipeline stages x tensor parallelism on 4 or 8) and
# checkpoint round trips on CUDA/NCCL with one process per GPU, in bf16.
#
#   bash scripts/gpu_smoke.sh            # every visible GPU (respects CUDA_VISIBLE_DEVICES)
#   NGPU=2 OUT=/tmp/smoke bash scripts/gpu_smoke.sh
#
# Exit code 0 when every run finished and the resumed run continued from the checkpoint;
# the summary lines are what docs/gpu.md records.
set -euo pipefail

NGPU=${NGPU:-$(python -c "import torch; print(torch.cuda.device_count())")}
if [ "$NGPU" -lt 1 ]; then
    echo "gpu_smoke: no CUDA device visible" >&2
    exit 1
fi
OUT=${OUT:-$(mktemp -d -t editrain-gpu-smoke.XXXXXX)}
# Two ranks per replica when there are at least 4 GPUs (FSDP2 shards inside a replica).
S=1
if [ "$NGPU" -ge 4 ] && [ $((NGPU % 2)) -eq 0 ]; then S=2; fi
COMMON=(--nproc "$NGPU" --shard-size "$S" --dist.device=cuda --dist.backend=nccl
        --train.precision=bf16 --model.preset=tiny --train.eval_every=10
        --data.max_bytes=2000000 --quiet)

run() {  # name, then editrain train options
    local name=$1; shift
    echo "== $name"
    editrain train "${COMMON[@]}" --run-dir "$OUT/$name" "$@"
    python - "$OUT/$name" <<'PY'
import json, sys
from pathlib import Path
rows = [json.loads(l) for l in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines()]
syncs = sum(1 for r in rows if "sync" in r)
val = [r["val_loss"] for r in rows if r.get("val_loss") is not None]
assert syncs > 0, "no sync ran"
assert val and all(v == v for v in val), "no finite validation loss"
print(f"   steps {rows[-1].get('step')}, syncs {syncs}, val loss {val[0]:.3f} -> {val[-1]:.3f}")
PY
}

run edit --method edit --steps 20 --sync.local_sgd_sync_interval 5 --checkpoint.every 10
run edit-resumed --method edit --steps 30 --sync.local_sgd_sync_interval 5 \
    --resume "$OUT/edit"
run streaming --method edit --steps 24 --sync.local_sgd_sync_interval 8 \
    --sync.overlap_steps 2 --sync.fragments 2 --sync.comm_dtype int8
run aedit-nb --method aedit --steps 24 --sync.local_sgd_sync_time 0.5 --sync.overlap_steps 2 \
    --sync.merge keep_local
if [ "$NGPU" -ge 2 ] && [ $((NGPU % 2)) -eq 0 ]; then
    # Tensor parallelism inside each replica: tp pairs, FSDP2 over what is left, NCCL.
    run tensor-parallel --method edit --steps 20 --sync.local_sgd_sync_interval 5 \
        --shard-size 1 --dist.tp_size 2 --train.grad_clip 1.0 --checkpoint.every 10
    run tensor-parallel-resumed --method edit --steps 30 --sync.local_sgd_sync_interval 5 \
        --shard-size 1 --dist.tp_size 2 --train.grad_clip 1.0 --resume "$OUT/tensor-parallel"
fi
if [ $((NGPU % 4)) -eq 0 ]; then
    # Pipeline stages x tensor parallelism inside each replica (2 stages of tp pairs; 4 GPUs:
    # one replica, 8: two), bf16 activations between the stages, NCCL; then a resume.
    PP=(--shard-size 1 --dist.tp_size 2 --dist.pp_size 2 --model.tie_embeddings false
        --train.grad_clip 1.0)
    run pipeline --method edit --steps 20 --sync.local_sgd_sync_interval 5 "${PP[@]}" \
        --checkpoint.every 10
    run pipeline-resumed --method edit --steps 30 --sync.local_sgd_sync_interval 5 \
        "${PP[@]}" --resume "$OUT/pipeline"
    # Interleaved 1F1B: each GPU holds 2 chunks of a 4-block model (pipeline ranks x tp
    # pairs as above), 4 microbatches.
    run pipeline-interleaved --method edit --steps 20 --sync.local_sgd_sync_interval 5 \
        "${PP[@]}" --model.n_layers 4 --dist.pp_schedule interleaved-1f1b \
        --dist.pp_stages_per_rank 2 --dist.pp_microbatches 4
fi
python -c "import torch; print('gpu_smoke: ok on', torch.cuda.device_count(), 'x',
torch.cuda.get_device_name(0), 'torch', torch.__version__)"
echo "runs in $OUT"
