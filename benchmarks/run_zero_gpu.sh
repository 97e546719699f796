# bench_zero.py (issue 14) on the GPUs of one machine. Run from the repository root:
#   NPROC=2 BENCH_ARGS="--model llama-886m --micro 4" bash benchmarks/run_zero_gpu.sh ARMS NAME
# JSON lines land in $OUT/NAME.jsonl (OUT default ./bench-out), each arm's output in $OUT/NAME-logs/;
# `python3 benchmarks/bench_zero.py --report $OUT/*.jsonl` prints the tables of several runs together.
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 benchmarks/bench_zero.py --nproc "${NPROC:-2}" ${1:+--arms $1} --out "$OUT/${2:-zero}.jsonl" \
    --logs "$OUT/${2:-zero}-logs" $BENCH_ARGS
