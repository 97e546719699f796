"""The multi-process harness itself: results, a failing rank's traceback, timeouts, no leaks."""

import multiprocessing as mp
import time

import pytest
import torch.distributed as dist

from plait.testing import DistributedTestError, run_distributed


def rank_body(x):
    return dist.get_rank() * x, dist.get_world_size()


def failing_body():
    if dist.get_rank() == 1:
        raise RuntimeError("rank one exploded with value 42")
    return "ok"


def hanging_body():
    if dist.get_rank() == 0:
        time.sleep(60)
    return "done"


def test_results_in_rank_order():
    assert run_distributed(rank_body, 3, 10) == [(0, 3), (10, 3), (20, 3)]


def test_failing_rank_traceback_is_reported():
    with pytest.raises(DistributedTestError) as err:
        run_distributed(failing_body, 2)
    msg = str(err.value)
    assert (
        "--- rank 1 ---" in msg
        and "rank one exploded with value 42" in msg
        and "failing_body" in msg
    )


def test_timeout_kills_and_reports_and_leaks_nothing():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"ranks \[0\] did not finish within 3s"):
        run_distributed(hanging_body, 2, timeout_s=3)
    assert time.monotonic() - start < 30
    assert not [p for p in mp.active_children() if p.name.startswith("ForkServerProcess")]
