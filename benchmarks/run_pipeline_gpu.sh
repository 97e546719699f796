# bench_pipeline.py (issues 15, 19) on the GPUs of one machine (NPROC, default 2; pp = NPROC), this tree and optionally an older one, same machine start.
# Run from the repository root:  bash benchmarks/run_pipeline_gpu.sh [NAME]
#   BASELINE=DIR  also run the plait package found in DIR (e.g. `git archive <rev> plait | tar -x -C DIR`)
#   SCHEDULES, MS, MBS, STEPS, TIMEOUT (seconds per run, default 400) override the defaults; EXTRA adds bench_pipeline.py arguments (e.g. '--engine 1,3'). Output: $OUT/NAME.jsonl, NAME.log, NAME-timelines.json.
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NAME=${1:-pipeline}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
ARGS="--schedules ${SCHEDULES:-1f1b,interleaved,zb-h1,zb-v} --micro-batches ${MS:-8,16} --micro-batch-sizes ${MBS:-1,2}
      --steps ${STEPS:-4} --out $OUT/$NAME.jsonl ${EXTRA:-}"
R="python3 -m torch.distributed.run --standalone --nproc-per-node ${NPROC:-2}"
if [ -n "$BASELINE" ]; then
  PYTHONPATH=$BASELINE:$PWD timeout ${TIMEOUT:-400} $R benchmarks/bench_pipeline.py $ARGS --label baseline 2>&1 \
    | grep -vE "^\[W|Warning|warn" | tee -a "$OUT/$NAME.log" | grep -E "^\|" 
fi
PYTHONPATH=${THIS:+$THIS:}$PWD timeout ${TIMEOUT:-400} $R benchmarks/bench_pipeline.py $ARGS --label "${LABEL:-this}" \
  --timelines "$OUT/$NAME-timelines.json" 2>&1 | grep -vE "^\[W|Warning|warn" | tee -a "$OUT/$NAME.log" | tail -60
