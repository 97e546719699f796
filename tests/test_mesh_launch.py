"""ParallelMesh layout and errors, launcher environment parsing."""

import pytest
import torch.distributed as dist

from plait.parallel import ParallelMesh, launch_info
from plait.parallel.launch import first_slurm_host
from plait.testing import run_distributed


def mesh_body(tp, pp, dp):
    m = ParallelMesh(tp=tp, pp=pp, dp=dp)
    return dict(
        rank=dist.get_rank(),
        coords=(m.pp_rank, m.dp_rank, m.tp_rank),
        tp=m.ranks("tp"),
        dp=m.ranks("dp"),
        pp=m.ranks("pp"),
        first=m.is_first_stage,
        last=m.is_last_stage,
        sizes=(m.size("pp"), m.size("dp"), m.size("tp")),
    )


def test_mesh_rank_layout_tp_fastest_then_dp_then_pp():
    out = run_distributed(mesh_body, 8, 2, 2, None)  # dp inferred: 8 / (2*2) = 2
    for r, info in enumerate(out):
        pp, dp, tp = r // 4, (r // 2) % 2, r % 2
        assert info["coords"] == (pp, dp, tp)
        assert info["sizes"] == (2, 2, 2)
        assert info["tp"] == [pp * 4 + dp * 2 + t for t in range(2)]
        assert info["dp"] == [pp * 4 + d * 2 + tp for d in range(2)]
        assert info["pp"] == [p * 4 + dp * 2 + tp for p in range(2)]
        assert info["first"] == (pp == 0) and info["last"] == (pp == 1)


def cp_mesh_body():
    m = ParallelMesh(tp=2, cp=2)  # dp inferred: 8 / (2*2) = 2
    return dict(
        coords=(m.dp_rank, m.cp_rank, m.tp_rank),
        cp=m.ranks("cp"),
        dp=m.ranks("dp"),
        dp_cp=dist.get_process_group_ranks(m.group("dp_cp")),
        dp_cp_rank=m.rank("dp_cp"),
        sizes=(m.size("dp"), m.size("cp"), m.size("dp_cp"), m.world_size),
    )


def test_mesh_rank_layout_with_context_parallel_tp_then_cp_then_dp():
    """(pp, dp, cp, tp) with tp fastest; ZeRO's dp x cp group holds the ranks of one tp rank across dp and cp,
    in dp-major order (its rank is dp_rank * cp + cp_rank)."""
    for r, info in enumerate(run_distributed(cp_mesh_body, 8)):
        dp, cp, tp = r // 4, (r // 2) % 2, r % 2
        assert info["coords"] == (dp, cp, tp) and info["sizes"] == (2, 2, 4, 8)
        assert info["cp"] == [dp * 4 + c * 2 + tp for c in range(2)]
        assert info["dp"] == [d * 4 + cp * 2 + tp for d in range(2)]
        assert info["dp_cp"] == [d * 4 + c * 2 + tp for d in range(2) for c in range(2)]
        assert info["dp_cp_rank"] == dp * 2 + cp


def ep_mesh_body(cp):
    m = ParallelMesh(tp=2, cp=cp, ep=2)  # dp inferred: 8 / (2 * cp)
    ranks = {d: dist.get_process_group_ranks(m.group(d)) for d in ("dp", "ep", "edp", "dp_cp")}
    return dict(
        ranks=ranks, coords={d: m.rank(d) for d in ranks}, sizes={d: m.size(d) for d in ranks}
    )


@pytest.mark.parametrize("cp", [1, 2])
def test_mesh_expert_parallel_ranks_are_neighbouring_dp_ranks(cp):
    """ep splits dp: dp_rank = edp_rank * ep + ep_rank; the ep group holds neighbouring dp ranks, the edp group
    the dp ranks of one ep rank; ZeRO's dp x cp group is unchanged."""
    dp = 4 // cp
    for r, info in enumerate(run_distributed(ep_mesh_body, 8, cp)):
        d, c, t = r // (2 * cp), (r // 2) % cp, r % 2
        rank_of = lambda dd, cc=c: dd * 2 * cp + cc * 2 + t  # noqa: E731
        e, edp = d % 2, d // 2
        assert info["sizes"] == {"dp": dp, "ep": 2, "edp": dp // 2, "dp_cp": dp * cp}
        assert info["coords"] == {"dp": d, "ep": e, "edp": edp, "dp_cp": d * cp + c}
        assert info["ranks"]["dp"] == [rank_of(x) for x in range(dp)]
        assert info["ranks"]["ep"] == [rank_of(edp * 2 + x) for x in range(2)]
        assert info["ranks"]["edp"] == [rank_of(x * 2 + e) for x in range(dp // 2)]
        assert info["ranks"]["dp_cp"] == [rank_of(x, y) for x in range(dp) for y in range(cp)]


def bad_mesh_body(tp, pp, dp):
    with pytest.raises(ValueError) as err:
        ParallelMesh(tp=tp, pp=pp, dp=dp)
    return str(err.value)


def test_world_not_divisible_by_tp_pp_names_numbers():
    msg = run_distributed(bad_mesh_body, 6, 4, 1, None)[0]
    assert "world size (6)" in msg and "tp x pp x cp = 4 x 1 x 1" in msg
    msg = run_distributed(bad_mesh_body, 4, 2, 1, 4)[0]
    assert "2 x 1 x 1 x 4 = 8" in msg and "world size is 4" in msg and "dp=2" in msg
    msg = run_distributed(bad_ep_mesh_body, 3)[0]
    assert (
        msg
        == "dp (3) is not divisible by ep (2); expert parallelism splits the dp ranks: choose ep from [1, 3]"
    )


def bad_ep_mesh_body():
    with pytest.raises(ValueError) as err:
        ParallelMesh(ep=2)
    return str(err.value)


def test_single_process_mesh_without_process_group():
    m = ParallelMesh()
    assert (m.tp, m.pp, m.dp, m.tp_rank, m.tp_group) == (1, 1, 1, 0, None)
    assert m.is_first_stage and m.is_last_stage
    with pytest.raises(ValueError, match="world size"):
        ParallelMesh(tp=2)


def test_launch_info_torchrun_and_slurm():
    t = launch_info(
        {
            "RANK": "3",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "MASTER_ADDR": "n0",
            "MASTER_PORT": "1234",
        }
    )
    assert (t.rank, t.world_size, t.local_rank, t.master_addr, t.master_port) == (
        3,
        8,
        1,
        "n0",
        1234,
    )
    s = launch_info(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "16",
            "SLURM_LOCALID": "1",
            "SLURM_NODELIST": "gpu[007-009,012]",
        }
    )
    assert (s.rank, s.world_size, s.local_rank, s.master_addr, s.master_port) == (
        5,
        16,
        1,
        "gpu007",
        29500,
    )
    assert launch_info({}).world_size == 1
    with pytest.raises(ValueError, match="rank 4"):
        launch_info({"RANK": "4", "WORLD_SIZE": "4"})


@pytest.mark.parametrize(
    "nodes,first",
    [("node1", "node1"), ("a[1-3]", "a1"), ("gpu-[10,12]x", "gpu-10"), ("h1,h2", "h1")],
)
def test_first_slurm_host(nodes, first):
    assert first_slurm_host(nodes) == first
