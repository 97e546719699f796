"""Ranks that disagree or stop early (CPU/gloo, 2 ranks).

* Ranks started with different configs or models are refused at ``initialize``, every rank raising the same
  ``ConfigError`` naming the keys, the values and the ranks (``plait.engine.ranks``, ``plait.parallel.agree``).
* A rank that ends through ``sys.exit(1)`` frees its peers at once (no exit barrier holds them for the
  collective timeout); a clean exit on every rank still leaves with status 0.
* ``comm.startup_timeout_s`` holds from ``initialize`` to the first step; ``init_distributed`` without a
  timeout starts with 600 s (not DeepSpeed's 30 minutes), and a timeout the script passed holds for the run.

Hang tests use timeouts of a few seconds and assert the peers end well inside the harness's limit, so the
code before the fix fails (waits for the 60-120 s group timeout) instead of hanging the suite.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import plait
from plait.config import ConfigError
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.testing import DistributedTestError, run_distributed
from helpers import micro_batch, tiny

FIX = (
    "start every rank with the same config and the same model (the same ds_config file, script arguments "
    "and model code on every node)"
)


def ds_config(lr=1e-3, stage=2, gas=1, comm=None):
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": lr}},
        "zero_optimization": {"stage": stage},
    }
    if comm is not None:
        cfg["comm"] = comm
    return cfg


def _refused(cfg, model_cfg=None, freeze=None, mesh=True):
    """The ConfigError text initialize raises on this rank (None when it trains a step instead)."""
    m = ParallelMesh() if mesh else None
    model = TransformerModel(model_cfg or tiny(), m or ParallelMesh(), seed=5)
    if freeze is not None:
        model.get_parameter(freeze).requires_grad_(False)
    try:
        engine = plait.initialize(model, cfg, mesh=m)
    except ConfigError as err:
        return str(err)
    engine.train_batch(
        iter([micro_batch(0, 0, dist.get_rank())] * cfg["gradient_accumulation_steps"])
    )
    return None


def _disagreement_body():
    r = dist.get_rank()
    return {
        "same": _refused(ds_config()),
        "lr": _refused(ds_config(lr=[1e-3, 3e-4][r])),
        "stage": _refused(ds_config(stage=[2, 3][r])),
        "gas": _refused(ds_config(gas=[1, 2][r])),
        "tp, before the mesh": _refused(
            {**ds_config(), "tensor_parallel": {"size": [1, 2][r]}}, mesh=False
        ),
        "model": _refused(ds_config(), model_cfg=tiny(ffn_hidden_size=[48, 64][r])),
        "frozen": _refused(ds_config(), freeze=[None, "layers.1.mlp.down_proj.weight"][r]),
    }


def test_ranks_started_with_different_configs_or_models_are_refused_naming_key_values_and_ranks():
    got = run_distributed(_disagreement_body, 2, timeout_s=90)
    assert got[0] == got[1]  # the same message on every rank
    msg = got[0]
    assert msg["same"] is None  # agreeing ranks train
    assert (
        msg["lr"]
        == f"ranks disagree on optimizer.params.lr (0.001 on rank 0; 0.0003 on rank 1); {FIX}"
    )
    assert msg["stage"] == (
        "ranks disagree on zero_optimization.overlap_comm (false on rank 0; true on rank 1) "
        "and on zero_optimization.stage (2 on rank 0; 3 on rank 1); " + FIX
    )  # 3: overlap on
    assert msg["gas"] == (
        "ranks disagree on gradient_accumulation_steps (1 on rank 0; 2 on rank 1) and on "
        f"train_batch_size (4 on rank 0; 8 on rank 1); {FIX}"
    )
    assert msg["tp, before the mesh"].startswith(
        "ranks disagree on tensor_parallel.size (1 on rank 0; 2 on rank 1)"
    )
    assert msg["model"].startswith(
        "ranks disagree on model.ffn_hidden_size (48 on rank 0; 64 on rank 1)"
    )
    assert msg["frozen"] == (
        "ranks disagree on parameter layers.1.mlp.down_proj.weight ([32, 48] float32 "
        f"trainable on rank 0; [32, 48] float32 frozen on rank 1); {FIX}"
    )


def test_rank_lists_name_runs_of_three_or_more_as_ranges():
    from plait.parallel.agree import rank_list

    assert rank_list([7, 0, 1, 2, 5, 8]) == "0-2,5,7,8" and rank_list([1]) == "1"


def _stalled_before_first_step_body():
    mesh = ParallelMesh()
    engine = plait.initialize(
        TransformerModel(tiny(), mesh, seed=5),
        ds_config(comm={"timeout_s": 60, "startup_timeout_s": 3}),
        mesh=mesh,
    )
    if mesh.dp_rank == 1:
        os.kill(
            os.getpid(), signal.SIGSTOP
        )  # stalls before step 1 (a slow data loader, a debugger)
    start = time.monotonic()
    try:
        engine.train_batch(iter([micro_batch(0, 0, mesh.dp_rank)]))
    except RuntimeError as err:
        raise RuntimeError(
            f"rank 0 caught the stalled peer after {time.monotonic() - start:.1f}s: {err}"
        ) from None
    return "not caught"


def test_a_rank_stalled_before_the_first_step_is_caught_after_the_startup_timeout():
    with pytest.raises(DistributedTestError) as err:  # the harness's group starts with 120 s
        run_distributed(_stalled_before_first_step_body, 2, timeout_s=100)
    caught = re.search(r"caught the stalled peer after (\d+\.\d)s", str(err.value))
    assert caught is not None, str(err.value)[-2000:]
    assert 2.5 <= float(caught.group(1)) <= 15, caught.group(0)  # startup_timeout_s = 3, not 120


def _group_timeout_s() -> float:
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


def _one_step(comm):
    mesh = ParallelMesh()
    engine = plait.initialize(
        TransformerModel(tiny(), mesh, seed=5), ds_config(comm=comm), mesh=mesh
    )
    at_start = _group_timeout_s()
    engine.train_batch(iter([micro_batch(0, 0, 0)]))
    return engine, at_start, _group_timeout_s()


@pytest.fixture
def leave_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_init_distributed_without_a_timeout_hands_over_to_the_comm_timeouts(leave_group):
    import plait.deepspeed as deepspeed

    deepspeed.init_distributed()
    assert _group_timeout_s() == 600.0  # not DeepSpeed's 30 minutes
    _, at_start, after_step = _one_step({"timeout_s": 7, "startup_timeout_s": 9})
    assert (at_start, after_step) == (9.0, 7.0)


def test_a_timeout_the_script_passed_to_init_distributed_holds_for_the_run_and_is_logged(
    leave_group, caplog
):
    import plait.deepspeed as deepspeed

    deepspeed.init_distributed(timeout=timedelta(seconds=42))
    with caplog.at_level("WARNING", logger="plait"):
        engine, at_start, after_step = _one_step({"timeout_s": 7, "startup_timeout_s": 9})
    assert (at_start, after_step) == (42.0, 42.0)
    assert (engine.config.comm.timeout_s, engine.config.comm.startup_timeout_s) == (42.0, 42.0)
    assert (
        "collectives keep the 42 s timeout the script passed to init_distributed for the whole run; "
        "comm.timeout_s (7 s) and comm.startup_timeout_s (9 s) are not applied"
    ) in caplog.text


EXIT_SCRIPT = textwrap.dedent("""
    import sys, time, torch, torch.distributed as dist
    from plait.parallel.launch import init_distributed, leave_at_exit
    init_distributed(timeout_s=60)
    leave_at_exit()
    t = torch.ones(4)
    dist.all_reduce(t)                          # both ranks joined and talked
    if sys.argv[1] == "exit" and dist.get_rank() == 1:
        sys.exit(1)                             # leaves while rank 0 waits in its next collective
    start = time.monotonic()
    try:
        dist.all_reduce(t)
    except RuntimeError:
        print(f"rank 0 freed after {time.monotonic() - start:.1f}s", flush=True)
        sys.exit(3)
    assert t[0].item() == 4.0
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(tmp_path, mode):
    """Start EXIT_SCRIPT on two ranks (torchrun's variables); return ([rc0, rc1], [out0, out1])."""
    script = tmp_path / "exits.py"
    script.write_text(EXIT_SCRIPT)
    base = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), mode],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=150)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{mode}: the ranks were still running after 150 s (the group timeout is 60 s)")
    return [p.returncode for p in procs], outs


def test_a_rank_that_exits_with_status_1_frees_its_peers_at_once(tmp_path):
    codes, outs = _two_ranks(tmp_path, "exit")
    assert codes == [3, 1], outs
    freed = float(re.search(r"rank 0 freed after (\d+\.\d)s", outs[0]).group(1))
    assert freed < 5, outs  # its collective's wait once rank 1 exited; the group timeout is 60 s


def test_ranks_that_all_finish_leave_with_status_0(tmp_path):
    codes, outs = _two_ranks(tmp_path, "clean")
    assert codes == [0, 0], outs
    assert not any("terminate called" in out or "Traceback" in out for out in outs), outs


MESH_FIRST_SCRIPT = textwrap.dedent("""
    import plait
    from plait.layers import TransformerModel
    from plait.models import preset
    from plait.parallel import ParallelMesh
    mesh = ParallelMesh()          # before the process group: a mesh of one rank (docs' nanoGPT row order)
    model = TransformerModel(preset("llama-tiny", vocab_size=257, num_layers=1, hidden_size=32, num_heads=4,
                                    num_kv_heads=2, ffn_hidden_size=48), mesh, seed=5)
    try:
        plait.initialize(model, {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}}, mesh=mesh)
    except plait.config.ConfigError as err:
        print("REFUSED", err, flush=True)
    else:
        print("TRAINS ALONE", flush=True)
""")


def test_a_mesh_made_before_the_process_group_is_refused_instead_of_each_rank_training_alone(
    tmp_path,
):
    """Under torchrun, ``ParallelMesh()`` before ``init_distributed`` spans one rank; ``initialize`` then joins
    the group itself and (before) trained each rank alone with no word."""
    script = tmp_path / "mesh_first.py"
    script.write_text(MESH_FIRST_SCRIPT)
    base = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=150)[0] for p in procs]
    said = [
        next((ln for ln in out.splitlines() if ln.startswith(("REFUSED", "TRAINS"))), out[-2000:])
        for out in outs
    ]
    assert (
        said
        == [
            "REFUSED the mesh spans 1 rank(s) (tp x pp x cp x dp = 1 x 1 x 1 x 1) but this job has 2 "
            "ranks: it was made before the process group started, and every rank would train alone. "
            "Call plait.parallel.init_distributed() before ParallelMesh(...) (as examples/pretrain_layout.py "
            "does), or pass no mesh to plait.initialize"
        ]
        * 2
    )
