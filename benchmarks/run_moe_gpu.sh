# bench_moe_model.py (issues 17 and 24) on 2 GPUs of one machine. Run from the repository root:
#   bash benchmarks/run_moe_gpu.sh [NAME]
# JSON lines land in $OUT/NAME.jsonl (OUT default ./bench-out, NAME default moe), each arm's output in
# $OUT/NAME-logs/ARM.log; ARMS, STEPS, MICRO, GAS and SEQ override the defaults; COMPILE=1 compiles the blocks;
# GC=freeze freezes the collector's start-up objects after the warm-up.
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NAME=${1:-moe}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 benchmarks/bench_moe_model.py --out "$OUT/$NAME.jsonl" --logs "$OUT/$NAME-logs" --steps "${STEPS:-10}" \
    --micro "${MICRO:-2}" --gas "${GAS:-1}" --seq "${SEQ:-2048}" ${ARMS:+--arms $ARMS} ${COMPILE:+--compile} \
    ${GC:+--gc $GC} --timeout "${TIMEOUT:-300}"
