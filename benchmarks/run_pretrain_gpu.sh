# examples/pretrain_gpt.py on GPUs (4 x H200): tokens/s and MFU for 1 GPU and for 4 GPUs with tp x pp and ZeRO.
# Run from the repository root; logs land in $OUT (default ./bench-out).
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
R="python3 -m torch.distributed.run --standalone"
COMMON="--model llama-886m --seq-len 2048 --micro-batch 4 --steps 12 --log-every 4 --eval-every 1000 --save-every 1000 --no-export --resume never"
CUDA_VISIBLE_DEVICES=0 timeout 200 $R --nproc-per-node 1 examples/pretrain_gpt.py $COMMON --tp 1 --pp 1 --zero-stage 2 \
    --global-batch 32 --out-dir /tmp/run1 > $OUT/pretrain_1gpu_z2.log 2>&1
timeout 200 $R --nproc-per-node 4 examples/pretrain_gpt.py $COMMON --tp 1 --pp 1 --zero-stage 2 \
    --global-batch 128 --out-dir /tmp/run4dp > $OUT/pretrain_4gpu_dp4_z2.log 2>&1
timeout 200 $R --nproc-per-node 4 examples/pretrain_gpt.py $COMMON --tp 2 --pp 2 --zero-stage 1 \
    --global-batch 32 --out-dir /tmp/run4tppp > $OUT/pretrain_4gpu_tp2pp2_z1.log 2>&1
for f in $OUT/pretrain_*.log; do echo "== $f"; grep -E "step +[0-9]+/|Error|error" "$f" | tail -3; done
