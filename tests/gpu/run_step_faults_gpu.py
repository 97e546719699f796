"""GPU check of the agreed micro-batch verdict (``plait.engine.guard``), run on one lent GPU:

    python tests/gpu/run_step_faults_gpu.py

Two ranks share the GPU over gloo (NCCL takes one GPU per rank), with every batch on the GPU, so each takes
the deferred path (``PendingCheck``, the clamped or cut stand-in). Rank 1's micro-batch holds an id past the
vocabulary, then a sequence past the positions; rank 0 gives int32 ids. Checks, at ZeRO-1 and 2: both ranks
raise the same error at ``engine.step()`` naming rank 1, nothing is applied, and the next step trains on both
(weights finite and equal on the two ranks). Prints one line per stage; exit 1 on failure.
"""

import os
import sys

import torch

import plait
from plait.layers import TransformerModel
from plait.models import preset
from plait.parallel import ParallelMesh
from plait.testing import run_distributed

V, GAS, SEQ = 1001, 2, 16


def batches(step, rank, seq=SEQ, dtype=torch.int64):
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, V, (GAS, 2, seq + 1), generator=g).to("cuda", dtype)
    return [
        {"input_ids": ids[j, :, :-1].clone(), "labels": ids[j, :, 1:].clone()} for j in range(GAS)
    ]


def body(stage):
    torch.cuda.set_device(0)
    mesh = ParallelMesh(device_type="cuda")
    cfg = preset(
        "llama-tiny",
        vocab_size=V,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=96,
        max_position_embeddings=SEQ,
    )
    conf = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine = plait.initialize(TransformerModel(cfg, mesh, seed=5, device="cuda"), conf, mesh=mesh)
    r, messages = mesh.dp_rank, []
    for case in ("id", "long"):
        bs = batches(
            0,
            r,
            SEQ + 1 if case == "long" and r == 1 else SEQ,
            torch.int32 if r == 0 else torch.int64,
        )
        if case == "id" and r == 1:
            bs[0]["input_ids"][1, 3] = V + 4
        try:
            for b in bs:
                engine.backward(engine(**b))
                engine.step()
            messages.append(None)
        except ValueError as err:
            messages.append(str(err))
    for b in batches(1, r):
        engine.backward(engine(**b))
        engine.step()
    with engine.optimizer.gathered_parameters():
        weights = torch.cat(
            [p.detach().float().flatten().cpu() for p in engine.module.parameters()]
        )
    return messages, engine.global_steps, weights


def main():
    failures = 0
    for stage in (1, 2):
        try:
            (m0, s0, w0), (m1, s1, w1) = run_distributed(body, 2, stage, timeout_s=300)
        except AssertionError as err:
            print(f"ZeRO-{stage}: FAILED to run: {err}", flush=True)
            failures += 1
            continue
        ok = (
            m0 == m1
            and all(m is not None and m.startswith("a bad micro-batch on rank 1 of 2") for m in m0)
            and f"input_ids[1, 3] = {V + 4}" in m0[0]
            and "sequences of 17 tokens" in m0[1]
            and s0 == s1 == 1
            and torch.isfinite(w0).all()
            and torch.equal(w0, w1)
        )
        failures += not ok
        print(
            f"ZeRO-{stage}: {'ok' if ok else 'FAILED'}: steps {s0}/{s1}, weights equal {torch.equal(w0, w1)}; "
            f"messages: {m0[0][:140]!r} | {m0[1][:200]!r}",
            flush=True,
        )
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    sys.exit(main())
