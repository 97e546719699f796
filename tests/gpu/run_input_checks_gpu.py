"""GPU check of the deferred micro-batch check (plait.engine.batch.screen_micro_batch), run on a lent GPU:

    python tests/gpu/run_input_checks_gpu.py

A batch on the GPU is screened without a synchronization: the model computes on clamped ids and the
engine raises at the accumulation boundary, before the optimizer step, naming value and position, after
dropping the step's gradients. Checks: valid batches train bit-identically with the check on and off;
a bad id or label (at tp=1, where the embedding and cross entropy would index out of range) raises at
engine.step() with nothing applied, and training then goes on. Prints one line per check; exit 1 on failure.
"""

import os
import sys

import torch

import plait
import plait.engine.guard as guard_mod
from plait.engine.batch import screen_micro_batch
from plait.layers import TransformerModel
from plait.models import preset
from plait.parallel import ParallelMesh

V, GAS = 1001, 2


def engine_and_batches():
    cfg = preset(
        "llama-tiny",
        vocab_size=V,
        num_layers=2,
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=96,
    )
    model = TransformerModel(cfg, None, seed=5, device="cuda")
    conf = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    }
    engine = plait.initialize(model, conf, mesh=ParallelMesh())
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3 * GAS):
        ids = torch.randint(0, V, (2, 17), generator=g).cuda()
        batches.append({"input_ids": ids[:, :-1].clone(), "labels": ids[:, 1:].clone()})
    return engine, batches


def train(engine, batches):
    for b in batches:
        engine.backward(engine(**b))
        engine.step()
    with engine.optimizer.gathered_parameters():
        return [p.detach().clone() for p in engine.module.parameters()]


def main():
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29633", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    torch.distributed.init_process_group("nccl")
    lines, failures = [], 0
    on, screened = train(*engine_and_batches()), screen_micro_batch
    guard_mod.screen_micro_batch = lambda b, v: (dict(b), None)
    off = train(*engine_and_batches())
    guard_mod.screen_micro_batch = screened
    same = all(torch.equal(a, b) for a, b in zip(on, off))
    failures += not same
    lines.append(f"valid batches, check on vs off: {'bit-identical' if same else 'DIFFER'}")
    for key, value, where in (
        ("input_ids", 5000, "input_ids[1, 3] = 5000"),
        ("input_ids", -7, "input_ids[1, 3] = -7"),
        ("labels", 1004, "labels[1, 3] = 1004"),
    ):
        engine, batches = engine_and_batches()
        batches[1][key][1, 3] = value
        engine.backward(engine(**batches[0]))
        engine.step()
        engine.backward(engine(**batches[1]))
        try:
            engine.step()
            msg = None
        except ValueError as err:
            msg = str(err)
        ok = msg is not None and where in msg and engine.global_steps == 0
        after = train(engine, batches[2:4])
        ok = ok and engine.global_steps == 1 and all(torch.isfinite(p).all() for p in after)
        failures += not ok
        lines.append(
            f"{where}: raised at step() {'naming it, nothing applied, training goes on' if ok else 'FAILED'}"
            f" ({msg})"
        )
    print("\n".join(lines), flush=True)
    torch.distributed.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
