# bench_context_parallel.py (issue 16) on 2 GPUs of one machine. Run from the repository root:
#   bash benchmarks/run_context_gpu.sh [all|throughput|longest] [NAME]
# throughput: plait-cp1 at L=32768 against plait-ring, plait-a2a and torch-cp at 2L (L, STEPS, ARMS override);
# longest: plait-ring-tiled (cp=2) over SEQS_CP2, then plait-tiled (cp=1) over SEQS_CP1, each stopping at its
# first failure (STEPS default 1). all (the default): both. One device command runs at most 600 s: there run
# the modes apart and split the longest sweep (e.g. SEQS_CP2=393216,524288 SEQS_CP1= for a second call).
# JSON lines land in $OUT/NAME.jsonl (OUT default ./bench-out, NAME default cp), each child's output in
# $OUT/NAME-logs/ARM-SEQ.log; `python3 benchmarks/bench_context_parallel.py --report $OUT/*.jsonl` prints
# the tables of several runs together.
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
MODE=${1:-all}; NAME=${2:-cp}
B="python3 benchmarks/bench_context_parallel.py --out $OUT/$NAME.jsonl --logs $OUT/$NAME-logs"
case "$MODE" in all|throughput|longest) ;; *) echo "usage: $0 [all|throughput|longest] [NAME]" >&2; exit 2 ;; esac
if [ "$MODE" != longest ]; then
    $B --L "${L:-32768}" --steps "${STEPS:-3}" ${ARMS:+--arms $ARMS} --timeout "${TIMEOUT:-600}"
fi
if [ "$MODE" != throughput ]; then
    SEQS_CP2=${SEQS_CP2-131072,196608,262144,393216,524288}; SEQS_CP1=${SEQS_CP1-131072,196608,262144}
    LONG="--longest --steps ${STEPS:-1} --timeout ${TIMEOUT:-900}"
    [ -n "$SEQS_CP2" ] && $B $LONG --arms plait-ring-tiled --seqs "$SEQS_CP2"
    [ -n "$SEQS_CP1" ] && $B $LONG --arms plait-tiled --seqs "$SEQS_CP1"
fi
python3 benchmarks/bench_context_parallel.py --report "$OUT/$NAME.jsonl"
