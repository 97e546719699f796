"""``plait.initialize`` under a launcher, the way a DeepSpeed script calls it: no ``init_distributed`` first.
Under ``torchrun --nproc-per-node 2`` the engine must join the job's process group (each rank once trained
alone, dp=1, until the first save raced), so both ranks see dp=2 and hold the same weights after steps on
different data."""

import json
import os
import subprocess
import sys

SCRIPT = """
import json, sys, torch, torch.distributed as dist
import plait
from plait.layers import TransformerModel
from plait.models import preset
cfg = preset("llama-tiny", vocab_size=257, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48)
engine = plait.initialize(TransformerModel(cfg, None, seed=5), {"train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 2}})
rank = dist.get_rank()
for step in range(2):
    ids = torch.randint(0, 257, (2, 17), generator=torch.Generator().manual_seed(10 * step + rank))
    engine.backward(engine(input_ids=ids[:, :-1], labels=ids[:, 1:]))
    engine.step()
engine.save_checkpoint(sys.argv[1])
with engine.optimizer.gathered_parameters():
    total = float(sum(p.detach().double().sum() for p in engine.module.parameters()))
with open(f"{sys.argv[1]}.rank{rank}.json", "w") as f:   # not stdout: the ranks' lines may interleave
    json.dump({"rank": rank, "dp": engine.mesh.dp, "world": dist.get_world_size(), "sum": total}, f)
"""


def test_initialize_joins_the_launchers_group(tmp_path):
    script = tmp_path / "ds_style.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(script),
            str(tmp_path / "ckpt"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads((tmp_path / f"ckpt.rank{r}.json").read_text()) for r in range(2)]
    assert sorted(r["rank"] for r in rows) == [0, 1]
    assert all(r["dp"] == 2 and r["world"] == 2 for r in rows)
    assert rows[0]["sum"] == rows[1]["sum"]  # gradients were averaged over both ranks
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step2"
