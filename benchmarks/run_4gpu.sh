# The 4-GPU runs of issues 18 and 19 on one machine, in parts that each fit one 10-minute device call.
# Run from the repository root:  bash benchmarks/run_4gpu.sh PART...   (output in $OUT, default ./bench-out)
#   pipe886   pp=4, llama-886m: 1F1B, interleaved, ZB-H1, ZB-V (+ZB-V planned), m 8/16/32, micro-batch 1/2,
#             forward+backward and engine.train_batch with ZeRO-1            (issue 19)
#   pipe59    pp=4, llama-5.9b, m=8, micro-batch 1/2, the same schedules and engine arms   (issue 19)
#   pipe59m   pp=4, llama-5.9b, m 16/32, micro-batch 1, forward+backward only              (issue 19)
#   zero      dp=4, llama-5.9b, micro-batch 2: FSDP2 and plait ZeRO-3 without and with activation
#             checkpointing, DeepSpeed ZeRO-3 with it                                       (issue 18)
#   zerocomp  the same with compile: FSDP2 and plait ZeRO-3, without and with checkpointing (issue 18)
#   layout    llama-5.9b through examples/pretrain_gpt.py: tp=2 x pp=2 ZeRO-1 against dp=4 ZeRO-1, same
#             global batch (32 x 2048 tokens), activation recomputation, compile off        (issue 19)
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export OUT PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
B=benchmarks
for part in "$@"; do
  case $part in
    pipe886) NPROC=4 MS=8,16,32 MBS=1,2 STEPS=3 TIMEOUT=270 EXTRA="--engine 1" bash $B/run_pipeline_gpu.sh pp4_886m ;;
    pipe59) NPROC=4 MS=8 MBS=1,2 STEPS=3 TIMEOUT=300 EXTRA="--engine 1 --preset llama-5.9b --no-plan" \
              bash $B/run_pipeline_gpu.sh pp4_59b_m8 ;;
    pipe59m) NPROC=4 MS=16,32 MBS=1 STEPS=2 TIMEOUT=300 EXTRA="--preset llama-5.9b --no-plan" \
              bash $B/run_pipeline_gpu.sh pp4_59b_m16_32 ;;
    zero) NPROC=4 BENCH_ARGS="--model llama-5.9b --micro 2 --steps 6 --timeout 110" \
            bash $B/run_zero_gpu.sh fsdp2,plait-z3 z59_noac
          NPROC=4 BENCH_ARGS="--model llama-5.9b --micro 2 --ac --steps 6 --timeout 110" \
            bash $B/run_zero_gpu.sh fsdp2,plait-z3,ds-z3 z59_ac ;;
    zerocomp) NPROC=4 BENCH_ARGS="--model llama-5.9b --micro 2 --steps 6 --timeout 150" \
            bash $B/run_zero_gpu.sh fsdp2-compile,plait-z3-compile z59_noac_compile
          NPROC=4 BENCH_ARGS="--model llama-5.9b --micro 2 --ac --steps 6 --timeout 150" \
            bash $B/run_zero_gpu.sh fsdp2-compile,plait-z3-compile z59_ac_compile ;;
    layout)
      C="--model llama-5.9b --seq-len 2048 --micro-batch 2 --global-batch 32 --recompute --compile off --steps 8
         --log-every 2 --eval-every 1000 --save-every 1000 --no-export --resume never --zero-stage 1"
      for lay in "2 2" "1 1"; do set -- $lay
        timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 4 examples/pretrain_gpt.py $C \
          --tp $1 --pp $2 --out-dir /tmp/run_tp$1pp$2 > $OUT/layout_59b_tp$1_pp$2.log 2>&1
        grep -E "step +[0-9]+/|Error" $OUT/layout_59b_tp$1_pp$2.log | tail -3
      done ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done
