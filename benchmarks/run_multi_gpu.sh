# Multi-GPU checks and benchmarks (4 GPUs): NCCL parity for tp and the engine, pipeline schedules, checkpoint I/O.
# Run from the repository root; results land in $OUT (default ./bench-out).
OUT=${OUT:-bench-out}; mkdir -p "$OUT"
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name --format=csv,noheader | head -4
R="python3 -m torch.distributed.run --standalone"
( CUDA_VISIBLE_DEVICES=0,1 timeout 120 $R --nproc-per-node 2 tests/gpu/run_tp_parity_nccl.py
  timeout 120 $R --nproc-per-node 4 tests/gpu/run_tp_parity_nccl.py
  CUDA_VISIBLE_DEVICES=0,1 timeout 120 $R --nproc-per-node 2 tests/gpu/run_engine_parity_nccl.py --tp 1
  timeout 150 $R --nproc-per-node 4 tests/gpu/run_engine_parity_nccl.py --tp 2 ) 2>&1 | grep -E "nccl|Error|error" | tee $OUT/nccl_parity.txt
timeout 200 $R --nproc-per-node 4 benchmarks/bench_pipeline.py --out $OUT/pipeline_pp4.jsonl > $OUT/pipeline_pp4.log 2>&1; tail -9 $OUT/pipeline_pp4.log
CUDA_VISIBLE_DEVICES=0,1 timeout 150 $R --nproc-per-node 2 benchmarks/bench_pipeline.py --out $OUT/pipeline_pp2.jsonl 2>&1 | grep -vE "^\[W|Warning" | tail -9 | tee $OUT/pipeline_pp2.txt
timeout 120 $R --nproc-per-node 4 benchmarks/bench_checkpoint.py --reshard --dir /tmp/ckb 2>&1 | tail -7 | tee $OUT/checkpoint.txt
