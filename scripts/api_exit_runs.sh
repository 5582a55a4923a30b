#!/bin/bash
# The library API's exit, N times (default 50): a 2-process torchrun (gloo) of
# examples/custom_loop.py --tiny --method diloco (editrain.edit in a user's loop, then
# editrain.shutdown()). Prints one line per run and the count of runs that ended with exit 0;
# exits 1 if any did not (e.g. SIGABRT from gloo's teardown: "terminate called without an
# active exception"). Usage: scripts/api_exit_runs.sh [N] [LOG_DIR]
set -u
n=${1:-50}
logs=${2:-$(mktemp -d)}
root=$(cd "$(dirname "$0")/.." && pwd)
ok=0
for i in $(seq 1 "$n"); do
  OMP_NUM_THREADS=1 timeout 600 torchrun --standalone --nproc-per-node 2 \
    "$root/examples/custom_loop.py" --tiny --method diloco --shard-size 1 \
    > "$logs/run_$i.log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] && ok=$((ok + 1))
  echo "run $i: exit $rc"
done
echo "$ok of $n runs ended with exit 0 (logs in $logs)"
[ "$ok" -eq "$n" ]
