# bench_compile.py (issue 13) on one GPU. Run from the repository root:
#   bash benchmarks/run_compile_gpu.sh [ARMS [NAME]]      e.g. ARMS=hand-eager,hand-compile NAME=compile_a
# JSON lines land in $OUT/NAME.jsonl (OUT default ./bench-out), each arm's output in /tmp/bench_compile_logs;
# `python3 benchmarks/bench_compile.py --report $OUT/*.jsonl` prints the tables of several runs together.
# BENCH_ARGS (e.g. "--steps 30") are passed on to bench_compile.py.
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 benchmarks/bench_compile.py ${1:+--arms $1} --out "$OUT/${2:-compile}.jsonl" --logs /tmp/bench_compile_logs $BENCH_ARGS
