#!/usr/bin/env bash
# The device calls of benchmarks/NEXT_GPU_SESSION.md, one subcommand a call (1 x H200 unless it says 2 GPUs):
#   bash benchmarks/run_next_gpu_session.sh trl|int8-21b|convergence|ds-largest|gpu-checks|titan-float8|
#        llama8b-dp1-a|llama8b-dp1-b|float8-gather|gpu-checks-2|llama8b-layouts
#   bash benchmarks/run_next_gpu_session.sh pair "A B" "C D"   # 2 GPUs: A then B on GPU 0, C then D on GPU 1
# Run from the repository root; results land in $OUT (default ./bench-out). Each step has its own timeout so
# that a call ends inside the device's 10 minutes with its partial results. The facts lines head each call's
# .txt. BENCH_SMOKE=1 runs the tiny CPU versions (checks the script here; GPU facts and wheels skipped).
set -o pipefail
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
SMOKE=${BENCH_SMOKE:-0}; DRY=; [ "$SMOKE" = 1 ] && DRY=--dry-run   # the new steps' CPU check: tiny shapes
export DEADLINE=${DEADLINE:-$(( $(date +%s) + ${CALL_SECONDS:-580} ))}   # one call's end, shared by pair's steps
left() { echo $(( DEADLINE - $(date +%s) )); }   # seconds of the call left for the next step

wheels() {   # the carried wheel folders named, installed into /tmp/site (README of the device: no network there)
  [ "$SMOKE" = 1 ] && return 0
  [ -n "$WHEELS_DONE" ] && { export PYTHONPATH=/tmp/site:$PYTHONPATH; return 0; }   # pair installed them once
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
titan-float8)   # issue 46: torchtitan 0.3's rowwise float8 as the peer, llama-5.9b seq 4096, one GPU (~4-5 min)
  wheels .whl-titan .whl-tao
  facts 2>&1 | tee "$OUT/bench_float8_titan_1xH200.txt"
  timeout ${TIMEOUT:-$(left)} python3 benchmarks/bench_float8.py $DRY \
    --arms ${ARMS:-titan-fp8-rowwise,plait-fp8-rowwise,titan-bf16,plait-bf16,fsdp2-fp8-rowwise} --micro 2 --gas 2 \
    --steps 4 --warmup 2 --timeout 150 --out "$OUT/bench_float8_titan_1xH200.jsonl" --logs "$OUT/logs_titan" \
    2>&1 | tee -a "$OUT/bench_float8_titan_1xH200.txt"
  ;;
llama8b-dp1-a|llama8b-dp1-b)   # issue 47 at dp=1: Llama-3-8B seq 8192 on one GPU (~4-6 min each)
  wheels .whl .whl-tao .whl-titan
  export TORCH_CUDA_ARCH_LIST=9.0   # DeepSpeed's JIT build misreads "9.0a" (device README)
  N=${1#llama8b-dp1-}; facts 2>&1 | tee "$OUT/llama8b_dp1_${N}_1xH200.txt"
  ARMS_A=plait-bf16,plait-fp8-tensorwise,fsdp2-bf16,fsdp2-fp8-tensorwise; ARMS_B=titan-bf16,titan-fp8-rowwise,ds-z3
  [ "$N" = a ] && A=${ARMS:-$ARMS_A} || A=${ARMS:-$ARMS_B}
  timeout ${TIMEOUT:-$(left)} python3 benchmarks/bench_llama8b.py --nproc 1 $DRY \
    --arms $A --timeout ${ARM_TIMEOUT:-150} --titan-no-cuda-graphs --steps 4 --warmup 2 \
    --out "$OUT/llama8b_dp1_${N}_1xH200.jsonl" --logs "$OUT/logs_8b_$N" 2>&1 | tee -a "$OUT/llama8b_dp1_${N}_1xH200.txt"
  ;;
float8-gather)   # issue 46: ZeRO-3 gathering float8 against bf16 weights, llama-5.9b seq 4096, 2 GPUs (~4 min)
  wheels .whl-tao
  facts 2>&1 | tee "$OUT/bench_float8_gather_2xH200.txt"
  timeout ${TIMEOUT:-$(left)} python3 benchmarks/bench_float8.py --nproc 2 --stage 3 $DRY \
    --arms ${ARMS:-plait-bf16,plait-fp8-tensorwise,plait-fp8-tensorwise-f8gather,fsdp2-fp8-tensorwise} \
    --micro 2 --gas 2 --steps 4 --warmup 2 --timeout 200 --out "$OUT/bench_float8_gather_2xH200.jsonl" \
    --logs "$OUT/logs_gather" 2>&1 | tee -a "$OUT/bench_float8_gather_2xH200.txt"
  ;;
gpu-checks-2)   # issue 45: the 2-GPU checks of tests/gpu/ over NCCL (~2-3 min)
  facts 2>&1 | tee "$OUT/gpu_checks_2xH200.txt"
  for t in "run_context_multi_gpu.py" "run_engine_parity_nccl.py --tp 1" "run_engine_parity_nccl.py --tp 2" \
    "run_tp_parity_nccl.py"; do
    timeout ${CHECK_TIMEOUT:-150} python3 -m torch.distributed.run --standalone --nproc-per-node 2 tests/gpu/$t \
      2>&1 | tee -a "$OUT/gpu_checks_2xH200.txt"
    echo "$t rc=${PIPESTATUS[0]}" | tee -a "$OUT/gpu_checks_2xH200.txt"
  done
  ;;
llama8b-layouts)   # issue 47: tp=2 and pp=2 on Llama-3-8B seq 8192, 2 GPUs, against plait-bf16 at dp=2 (~6 min)
  wheels .whl-tao
  facts 2>&1 | tee "$OUT/llama8b_layouts_2xH200.txt"
  timeout ${TIMEOUT:-$(left)} python3 benchmarks/bench_llama8b.py --nproc 2 $DRY \
    --arms ${ARMS:-plait-bf16,plait-tp2,plait-pp2-1f1b,plait-pp2-zbh1} --timeout ${ARM_TIMEOUT:-150} --steps 4 \
    --warmup 2 --out "$OUT/llama8b_layouts_2xH200.jsonl" --logs "$OUT/logs_layouts" \
    2>&1 | tee -a "$OUT/llama8b_layouts_2xH200.txt"
  ;;
pair)   # two single-GPU streams at once on a 2-GPU machine: "$2" on GPU 0, "$3" on GPU 1 (each a list of steps)
  wheels .whl .whl-tao .whl-titan; export WHEELS_DONE=1
  (for c in $2; do CUDA_VISIBLE_DEVICES=0 bash "$0" "$c"; done) > "$OUT/pair_gpu0.txt" 2>&1 &
  (for c in $3; do CUDA_VISIBLE_DEVICES=1 bash "$0" "$c"; done) > "$OUT/pair_gpu1.txt" 2>&1 &
  wait
  ;;
*)
  echo "usage: bash benchmarks/run_next_gpu_session.sh trl|int8-21b|convergence|ds-largest|gpu-checks|titan-float8|llama8b-dp1-a|llama8b-dp1-b|float8-gather|gpu-checks-2|llama8b-layouts|pair" >&2
  exit 2
  ;;
esac
