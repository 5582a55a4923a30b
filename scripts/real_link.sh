#!/usr/bin/env bash
# Two replicas over a real, shaped network link: one network namespace per replica, joined
# by a veth pair whose both ends are shaped with tc's token bucket (tbf), one torchrun node
# per namespace (gloo over the veth). Each setting runs on the unshaped link and on the
# shaped one, interleaved, REPEATS times; the tokens/s ratio (shaped / unshaped, within a
# repeat) is what the setting keeps of its speed. Needs root (ip netns, tc).
#
#   RATE=1mbit REPEATS=3 bash scripts/real_link.sh            # writes OUT/results.json
#   RATE="10mbit 1mbit" ... bash scripts/real_link.sh        # OUT/<rate>/results.json each
#
# Variables (defaults in brackets):
#   RATE      the link's rate, both directions, as tc writes it [1mbit]; several rates
#             (space-separated) share each repeat's unshaped run, one record per rate
#   REPEATS   interleaved repeats [3]
#   STEPS     training steps per run [128]
#   H         steps per round (sync.local_sgd_sync_interval) [32]: 4 syncs of 128 steps
#   PRESET    model preset [tiny]
#   EVAL_EVERY  steps between evaluations [STEPS: only the first and the final one]
#   OUT       results directory, new or empty [real_link_results]; OVERWRITE=1 replaces
#             the runs of an earlier call in it
#   SETTINGS  space-separated names of the settings below [streaming-int8 sparse-topk2]
#   FRAGMENTS fragments of the torchft-d<D> settings [2]; must divide H
#   PYTHON    the interpreter with editrain installed [python]
#
# Settings (the model and data are the bench's quick size: tiny preset, untied embeddings,
# vocabulary 2048, batch 8 x 64 tokens):
#   streaming-int8  edit, fragments 4, overlap_steps 4, int8 (bench bandwidth's streaming)
#   sparse-topk2    edit, overlap_steps 31 (H - 1), topk2 (1/128 of fp32 on the wire)
#   eager-topk2     edit, overlap_steps H, the eager merge, topk2 (a whole round in flight;
#                   evaluations and the end cost no cross-replica bytes beyond the rounds')
#   plain-fp32      edit, the layer-wise sync of the next forward, fp32
#   torchft-d<D>    the peer: torchft's streaming DiLoCo (torchft.local_sgd.DiLoCo through
#                   editrain.bench.torchft_peer), FRAGMENTS fragments (editrain's units,
#                   strided as sync.fragments strides them), fragment_sync_delay D
#                   (0 <= D < H / FRAGMENTS), fragment_update_alpha 0, fp32 all-reduce
#                   (torchft quantizes only with triton, on a GPU); the same model, data,
#                   inner optimizer and schedule, H and outer optimizer (edit's) as the
#                   editrain settings. Its lighthouse runs in the first namespace, at
#                   ADDR0:LIGHTHOUSE_PORT: the second replica's quorum requests and
#                   heartbeats cross the shaped link, as its rendezvous with torchrun's
#                   store (also in the first namespace) does for editrain.
set -euo pipefail

RATE=${RATE:-1mbit}
REPEATS=${REPEATS:-3}
STEPS=${STEPS:-128}
H=${H:-32}
PRESET=${PRESET:-tiny}
EVAL_EVERY=${EVAL_EVERY:-$STEPS}
OUT=${OUT:-real_link_results}
SETTINGS=${SETTINGS:-streaming-int8 sparse-topk2}
FRAGMENTS=${FRAGMENTS:-2}
PYTHON=${PYTHON:-python}
NS=(edr_link0 edr_link1)
DEV=(edr_veth0 edr_veth1)
ADDR=(10.77.0.1 10.77.0.2)
PORT=29555
LIGHTHOUSE_PORT=29556

declare -A OPTIONS=(
    [streaming-int8]="--sync.fragments 4 --sync.overlap_steps 4 --sync.comm_dtype int8 --sync.merge keep_local"
    [sparse-topk2]="--sync.overlap_steps $((H - 1)) --sync.comm_dtype topk2 --sync.merge keep_local"
    [eager-topk2]="--sync.overlap_steps $H --sync.comm_dtype topk2 --sync.merge eager"
    [plain-fp32]=""
)
COMMON=(--method edit --sync.local_sgd_sync_interval "$H" --steps "$STEPS"
        --train.eval_every "$EVAL_EVERY" --train.warmup_steps 10 --train.batch_size 8
        --train.seq_len 64 --model.preset "$PRESET" --model.tie_embeddings false
        --data.max_bytes 1500000 --data.vocab_size 2048 --data.val_fraction 0.03
        --checkpoint.final false --dist.shard_size 1 --quiet)

for s in $SETTINGS; do
    if [[ $s =~ ^torchft-d([0-9]+)$ ]]; then
        d=${BASH_REMATCH[1]}
        if (( H % FRAGMENTS != 0 || d >= H / FRAGMENTS )); then
            echo "setting $s: FRAGMENTS ($FRAGMENTS) must divide H ($H) and the delay must" \
                 "be below H / FRAGMENTS" >&2; exit 2
        fi
        continue
    fi
    [[ -v "OPTIONS[$s]" ]] || {
        echo "unknown setting $s; known: ${!OPTIONS[*]} torchft-d<D>" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "needs root (ip netns, tc)" >&2; exit 2; }
if [ -d "$OUT" ] && [ -n "$(ls -A "$OUT")" ] && [ "${OVERWRITE:-0}" != 1 ]; then
    echo "OUT=$OUT is not empty; choose a new directory or set OVERWRITE=1" >&2; exit 2
fi

cleanup() {
    for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT

setup_link() {
    cleanup
    for i in 0 1; do ip netns add "${NS[$i]}"; done
    ip link add "${DEV[0]}" type veth peer name "${DEV[1]}"
    for i in 0 1; do
        ip link set "${DEV[$i]}" netns "${NS[$i]}"
        ip -n "${NS[$i]}" addr add "${ADDR[$i]}/24" dev "${DEV[$i]}"
        ip -n "${NS[$i]}" link set "${DEV[$i]}" up
        ip -n "${NS[$i]}" link set lo up
    done
}

shape() {  # shape RATE|none
    for i in 0 1; do
        ip netns exec "${NS[$i]}" tc qdisc del dev "${DEV[$i]}" root 2>/dev/null || true
        if [ "$1" != none ]; then
            # The bucket holds 32 KB; up to 4 MB may queue (no drops from the shaper).
            ip netns exec "${NS[$i]}" tc qdisc add dev "${DEV[$i]}" root tbf rate "$1" \
                burst 32kb limit 4mb
        fi
    done
}

run_pair() {  # run_pair RUN_DIR OPTIONS...
    local dir=$1; shift
    local pids=()
    for i in 0 1; do
        ip netns exec "${NS[$i]}" env GLOO_SOCKET_IFNAME="${DEV[$i]}" \
            "$PYTHON" -m torch.distributed.run --nnodes 2 --nproc-per-node 1 \
            --node-rank "$i" --master-addr "${ADDR[0]}" --master-port "$PORT" \
            -m editrain train --run-dir "$dir" --overwrite "${COMMON[@]}" "$@" \
            > "$dir.node$i.log" 2>&1 &
        pids+=($!)
    done
    local rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    return $rc
}

run_torchft_pair() {  # run_torchft_pair RUN_DIR DELAY
    local dir=$1 delay=$2
    local pids=() rc=0 lighthouse
    rm -rf "$dir"
    mkdir -p "$dir"
    ip netns exec "${NS[0]}" "$PYTHON" -m editrain.bench.torchft_peer \
        --serve-lighthouse "${ADDR[0]}:$LIGHTHOUSE_PORT" --replicas 2 \
        > "$dir.lighthouse.log" 2>&1 &
    lighthouse=$!
    for _ in $(seq 600); do  # up to a minute for it to listen
        grep -q "lighthouse ready" "$dir.lighthouse.log" 2>/dev/null && break
        kill -0 "$lighthouse" 2>/dev/null || break
        sleep 0.1
    done
    for i in 0 1; do
        ip netns exec "${NS[$i]}" env GLOO_SOCKET_IFNAME="${DEV[$i]}" \
            "$PYTHON" -m editrain.bench.torchft_peer --replica "$i" --replicas 2 \
            --lighthouse "http://${ADDR[0]}:$LIGHTHOUSE_PORT" --address "${ADDR[$i]}" \
            --run-dir "$dir" --fragments "$FRAGMENTS" --delay "$delay" \
            -- "${COMMON[@]}" > "$dir.node$i.log" 2>&1 &
        pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    kill "$lighthouse" 2>/dev/null || true
    wait "$lighthouse" 2>/dev/null || true
    return $rc
}

STARTED=$(date +%s)
mkdir -p "$OUT"
"$PYTHON" -m editrain data "${COMMON[@]}" > "$OUT/data.log" 2>&1  # tokenise once, ahead
setup_link
for rep in $(seq 1 "$REPEATS"); do
    for s in $SETTINGS; do
        for link in unshaped $RATE; do
            shape "$([ "$link" = unshaped ] && echo none || echo "$link")"
            dir="$OUT/$s-$link-r$rep"
            echo "[real_link] $s on $link, repeat $rep ..."
            if [[ $s =~ ^torchft-d([0-9]+)$ ]]; then
                run_torchft_pair "$dir" "${BASH_REMATCH[1]}" ||
                    echo "[real_link] $dir failed (see $dir.node*.log)"
                continue
            fi
            # shellcheck disable=SC2086  # the options are words
            run_pair "$dir" ${OPTIONS[$s]} || echo "[real_link] $dir failed (see $dir.node*.log)"
        done
    done
done
for rate in $RATE; do
    into=$OUT
    [ "$rate" = "$RATE" ] || into=$OUT/$rate
    # shellcheck disable=SC2086  # the settings are words
    "$PYTHON" -m editrain.bench.real_link "$OUT" --rate "$rate" --repeats "$REPEATS" \
        --started "$STARTED" --settings $SETTINGS --preset "$PRESET" --H "$H" \
        --steps "$STEPS" --eval-every "$EVAL_EVERY" --fragments "$FRAGMENTS" \
        --rates "$RATE" --into "$into"
done
