#!/usr/bin/env bash
# The device calls of benchmarks/NEXT_GPU_SESSION.md (issues 42 and 43), one subcommand a call, 1 x H200:
#   bash benchmarks/run_next_gpu_session.sh trl|int8-21b|convergence|ds-largest|gpu-checks
# Run from the repository root; results land in $OUT (default ./bench-out). Each step has its own timeout so
# that a call ends inside the device's 10 minutes with its partial results. The facts lines head each call's
# .txt. BENCH_SMOKE=1 runs the tiny CPU versions (checks the script here; GPU facts and wheels skipped).
set -o pipefail
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SMOKE=${BENCH_SMOKE:-0}

wheels() {   # the carried wheel folders named, installed into /tmp/site (README of the device: no network there)
  [ "$SMOKE" = 1 ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(for d in "$@"; do ls "$d"/*.whl; done) || { echo "wheel install failed: carry $*"; exit 1; }
  export PYTHONPATH=/tmp/site:$PYTHONPATH
}

facts() {    # what the results depend on, at the top of every call's output
  date -u
  [ "$SMOKE" = 1 ] || nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
  python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
  python3 -m pip list 2>/dev/null | grep -i -E '^(trl|datasets|pyarrow|deepspeed|accelerate|torchao) '
  grep -E 'MemTotal|MemAvailable' /proc/meminfo; df -h /tmp | tail -1; nproc
}

case "$1" in
trl)   # issue 42: TRL SFTTrainer on TinyLlama's shape, plait vs DeepSpeed, ZeRO-2 and ZeRO-3 (~4 min)
  wheels .whl .whl-trl
  facts 2>&1 | tee "$OUT/trl_sft_1xH200.txt"
  STEPS=${STEPS:-20}; WARMUP=${WARMUP:-5}; [ "$SMOKE" = 1 ] && { STEPS=2; WARMUP=1; }
  timeout ${TIMEOUT:-480} python3 benchmarks/bench_trl.py --arms ${ARMS:-plait-z2,ds-z2,plait-z3,ds-z3} \
    --steps $STEPS --warmup $WARMUP --out "$OUT/trl_sft_1xH200.jsonl" --log "$OUT/trl_sft_1xH200.log" \
    2>&1 | tee -a "$OUT/trl_sft_1xH200.txt"
  ;;
int8-21b)   # issue 43: 20.68B Llama, int8 Adam moments, ZeRO-3 GPU-first, through the Trainer (~5-7 min)
  facts 2>&1 | tee "$OUT/hf_trainer_int8_1xH200.txt"
  COMMON="--largest 21b --frameworks plait --state-dtype int8 --act-ckpt --steps ${STEPS:-8} --warmup ${WARMUP:-2}"
  COMMON="$COMMON --out $OUT/hf_trainer_int8_1xH200.jsonl --log $OUT/hf_trainer_int8_1xH200.log"
  timeout ${TIMEOUT:-500} python3 benchmarks/bench_hf_trainer.py $COMMON --ratio ${RATIO:-0.5} --micro ${MICRO:-4} \
    2>&1 | tee -a "$OUT/hf_trainer_int8_1xH200.txt"
  # one retry on the same checkpoint, in the call's remaining seconds, if the first placement failed: CUDA out of
  # memory -> more on the host, else (host OOM: SIGKILL) -> less; micro-batch 1 either way
  # (plait estimate-memory, 1 x H200: 0.55 needs 111.8 GiB GPU / 109 GiB host; 0.45 126.4 / 90.8)
  if grep -q '"error"' "$OUT/hf_trainer_int8_1xH200.jsonl" 2>/dev/null; then
    if grep -q 'out of memory' "$OUT/hf_trainer_int8_1xH200.jsonl"; then R=0.55; else R=0.45; fi
    timeout $(( ${CALL_SECONDS:-580} - SECONDS )) python3 benchmarks/bench_hf_trainer.py $COMMON --ratio $R --micro 1 \
      2>&1 | tee -a "$OUT/hf_trainer_int8_1xH200.txt"
  fi
  ;;
convergence)   # issue 43: 500 steps of llama-886m, fp32 / bf16 / int8 moments (~5.5 min)
  # disk first (64 GiB): int8-21b's 41 GB checkpoint, and the folders of an earlier run of this step (each arm
  # saves its step-500 checkpoint, kept until the script ends); on 2026-11-29 the int8 arm's save hit ENOSPC
  rm -rf /tmp/bench_llama_21b /tmp/bench_state_dtype_*
  facts 2>&1 | tee "$OUT/state_dtype_886m_1xH200.txt"
  ARGS="--arm-timeout ${ARM_TIMEOUT:-175}"; [ "$SMOKE" = 1 ] && ARGS="--dry-run"
  timeout ${TIMEOUT:-560} python3 benchmarks/bench_state_dtype.py $ARGS --out "$OUT/state_dtype_886m_1xH200.jsonl" \
    --log "$OUT/state_dtype_886m_1xH200.log" --table "$OUT/state_dtype_886m_1xH200.md" \
    2>&1 | tee -a "$OUT/state_dtype_886m_1xH200.txt"
  ;;
ds-largest)   # issue 43: DeepSpeed's largest with ZeRO-3, weights on the GPU, offload_optimizer.ratio (~4-5 min)
  wheels .whl
  rm -rf /tmp/bench_llama_21b   # the 41 GB checkpoint of int8-21b, if this machine still holds it (64 GiB disk)
  facts 2>&1 | tee "$OUT/hf_trainer_ds_largest_1xH200.txt"
  timeout ${TIMEOUT:-540} python3 benchmarks/bench_hf_trainer.py --largest ${SIZES:-10b} --ratio ${RATIO:-0.5} \
    --frameworks ds --act-ckpt --micro 4 --steps ${STEPS:-4} --warmup ${WARMUP:-2} \
    --out "$OUT/hf_trainer_ds_largest_1xH200.jsonl" --log "$OUT/hf_trainer_ds_largest_1xH200.log" \
    2>&1 | tee -a "$OUT/hf_trainer_ds_largest_1xH200.txt"
  ;;
gpu-checks)   # single-GPU checks of tests/gpu/ (CHECKS names them; ~2-4 min; needs a GPU)
  facts 2>&1 | tee "$OUT/gpu_checks_1xH200.txt"
  for t in ${CHECKS:-run_fused_cross_entropy_gpu run_step_faults_gpu}; do
    timeout ${CHECK_TIMEOUT:-150} python3 "tests/gpu/$t.py" 2>&1 | tee -a "$OUT/gpu_checks_1xH200.txt"
    echo "$t rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpu_checks_1xH200.txt"
  done
  ;;
*)
  echo "usage: bash benchmarks/run_next_gpu_session.sh trl|int8-21b|convergence|ds-largest|gpu-checks" >&2
  exit 2
  ;;
esac
