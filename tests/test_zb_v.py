"""ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024): the V placement, the
greedy list scheduler's bubble and memory in the simulator, and the executor on CPU/gloo.

Cost model of the simulator tests: one chunk's F = BI = BW = 1 (the paper's setting), Fractions for exact
comparisons; whole-stage schedules (1F1B, ZB-H1) run the same model at twice the cost per action (a chunk
is half a stage). The lower bound of a synchronous step is ``6m + p - 1``: every rank computes ``6m``, and
the last rank cannot start before the first micro-batch's chunk-forwards on ranks ``0 .. p-2``.

Executor parity (whole-model parity against the float64 reference, pp 2 and 4, tp, dp, both families) is
in ``test_pipeline_parity.py``; ZeRO-3 in ``test_zb_zero3.py``. Here: ZeRO-1 through the engine (the same
training as 1F1B, bitwise: the same products in the same order) and the refusal of chunks built for
another placement.
"""

import random
from fractions import Fraction as Fr

import pytest
import torch.distributed as dist

import plait
from plait.config import ConfigError, PipelineConfig
from plait.layers.stages import build_stage_modules
from plait.parallel import ParallelMesh
from plait.parallel.pipeline.parallel import PipelineParallel
from plait.parallel.pipeline.check import check_schedule
from plait.parallel.pipeline.schedules import Action, one_f_one_b, rank_chunk_of, stage_of, zb_h1
from plait.parallel.pipeline.registry import get_schedule, placement
from plait.parallel.pipeline.zb_v import zb_v
from plait.parallel.pipeline.executor import ActionTime
from plait.parallel.pipeline.simulate import render, simulate, stage_costs
from plait.parallel.pipeline.comm_actions import with_communication
from plait.testing import run_distributed
import helpers

CHUNK = dict(cost_f=Fr(1), cost_b=Fr(2), cost_bi=Fr(1), cost_bw=Fr(1))
STAGE = dict(cost_f=Fr(2), cost_b=Fr(4), cost_bi=Fr(2), cost_bw=Fr(2))


def test_v_placement_goes_down_the_ranks_and_back():
    assert [stage_of(r, c, 4, "v") for c in range(2) for r in range(4)] == [0, 1, 2, 3, 7, 6, 5, 4]
    assert [rank_chunk_of(s, 4, "v") for s in range(8)] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (3, 0),
        (3, 1),
        (2, 1),
        (1, 1),
        (0, 1),
    ]
    assert placement("zb-v") == "v" and placement("interleaved") == "loop"
    with pytest.raises(ValueError, match="unknown stage placement 'w'"):
        stage_of(0, 0, 2, "w")
    with pytest.raises(ValueError, match="runs v=2 chunks per rank .* got v=3"):
        get_schedule("zb-v", 2, 4, 3)


@pytest.mark.parametrize("p", range(1, 9))
def test_zb_v_reaches_the_bound_with_1f1b_memory(p):
    """Every m: a valid list, at most 2p chunk-forwards awaiting their BW (1F1B's first rank: p whole
    stages). m >= 2p: the makespan is the bound 6m + p - 1 (p in 5..7: within 2 of it), below ZB-H1's
    6m + 2(p - 1) for p > 1 and 1F1B's 6m + 6(p - 1)."""
    for m in range(1, 3 * p + 2):
        lists = zb_v(p, m)
        check_schedule(lists, p, m, 2, "v")
        res = simulate(lists, p, 2, shape="v", **CHUNK)
        assert max(res.peak_unfinished) <= 2 * p, (m, res.peak_unfinished)
        if m < 2 * p:
            continue
        bound = 6 * m + p - 1
        assert bound <= res.makespan <= bound + (2 if p in (5, 6, 7) else 0), (m, res.makespan)
        if p > 1:
            assert res.makespan < simulate(zb_h1(p, m), p, **STAGE).makespan == 6 * m + 2 * (p - 1)
            assert simulate(one_f_one_b(p, m), p, **STAGE).makespan == 6 * m + 6 * (p - 1)


def test_zb_v_exact_timeline_p2_m4():
    assert render(simulate(zb_v(2, 4), 2, 2, shape="v", **CHUNK)).splitlines() == [
        "rank 0: F0a F1a F2a F0b I0b W0b F1b I0a I1b W0a F3a I1a W1b F2b I2b W1a W2b I2a W2a F3b I3b W3b ... I3a W3a",
        "rank 1: ... F0a F0b F1a F1b I0b I0a W0b F2a I1b I1a W0a F2b W1b F3a I2b I2a W1a F3b W2b W2a I3b I3a W3b W3a",
    ]


def test_the_turn_of_the_v_is_a_hand_over_without_transfers():
    """Rank p-1 holds stages p-1 and p: no SEND/RECV between its two chunks; every other hop has one."""
    p, m = 3, 4
    lists = with_communication(zb_v(p, m), p, 2, shape="v")
    check_schedule(lists, p, m, 2, "v")
    last = [a for a in lists[p - 1] if not a.is_compute]
    assert not [
        a
        for a in last
        if a.kind == "SEND_F" and a.chunk == 0 or a.kind == "RECV_F" and a.chunk == 1
    ]
    assert not [
        a
        for a in last
        if a.kind == "SEND_B" and a.chunk == 1 or a.kind == "RECV_B" and a.chunk == 0
    ]
    sends = sum(a.kind.startswith("SEND") for acts in lists for a in acts)
    assert sends == 2 * m * (2 * p - 2)  # 2p - 1 hops, one of them local, both directions
    turn = list(lists[p - 1])  # a transfer across the turn is refused, not run
    turn.insert(turn.index(Action("F", 0, 0)) + 1, Action("SEND_F", 0, 0))
    turn.insert(turn.index(Action("F", 0, 1)), Action("RECV_F", 0, 1))
    with pytest.raises(
        ValueError,
        match=r"rank 2, action #\d+ \(SEND_F0\): a transfer to a stage on this same rank",
    ):
        check_schedule(lists[: p - 1] + [turn], p, m, 2, "v")


# Per-virtual-stage times (ms, rounded to 0.5) measured on 2 x H100 for llama-886m at micro-batch 2 under
# the V placement (benchmarks/results/pipeline_zbv_2xH100.md): stage 0's BI is empty and its BW a whole
# backward; a host-bound BI costs about 2.5 x BW.
MEASURED = {
    "F": [Fr(9, 2), Fr(9, 2), 6, 5],
    "BI": [0, 8, 8, 7],
    "BW": [Fr(19, 2), Fr(5, 2), Fr(7, 2), 3],
}


def at(costs: dict) -> dict:
    """simulate's arguments for ZB-V lists (F, BI and BW only) at per-stage ``costs``."""
    return dict(cost_f=costs["F"], cost_bi=costs["BI"], cost_bw=costs["BW"], shape="v")


def test_zb_v_planned_for_measured_costs_leaves_almost_no_bubble():
    """The unit-cost list run at the measured times idles rank 1 (the busier) 13-14%: rank 0 fills its
    places with stage-0 forwards and the stage-0 BW (a whole backward) delays the stage-3 forwards rank 1
    waits for. Planned for those times, the bubble is what the first forward and the last BW of a step
    force: 6 of rank 1's 65 x m/2 (m=8: 266 against 260 busy; m=16: 526 against 520), same peak memory."""
    for m, unit, planned in ((8, Fr(593, 2), 266), (16, Fr(1177, 2), 526)):
        lists = zb_v(2, m, costs=MEASURED)
        check_schedule(lists, 2, m, 2, "v")
        got, old = simulate(lists, 2, 2, **at(MEASURED)), simulate(zb_v(2, m), 2, 2, **at(MEASURED))
        assert (old.makespan, got.makespan, max(got.busy)) == (unit, planned, 65 * m // 2)
        assert got.peak_unfinished == old.peak_unfinished == (4, 4)


# llama-5.9b at pp=4, micro-batch 1, ms per virtual stage (benchmarks/results/pipeline_pp4_4xH100/, rounded to 0.1)
MEASURED_PP4 = {
    "F": [Fr(9, 2), Fr(15, 2), Fr(61, 10), 6, 6, Fr(39, 5), Fr(31, 5), Fr(29, 5)],
    "BI": [0, Fr(103, 10), Fr(42, 5), Fr(81, 10), Fr(81, 10), Fr(52, 5), Fr(83, 10), Fr(37, 5)],
    "BW": [Fr(21, 2), Fr(69, 10), Fr(28, 5), Fr(11, 2), Fr(11, 2), 7, Fr(11, 2), 5],
}


def test_zb_v_keeps_the_best_of_jittered_plans():
    """At these pp=4 costs the single greedy list (tries=1) idles the busiest rank 13.8% at m=8; another
    measurement of the same stages planned 7%. The best of 16 plans for costs jittered by 5% gives 5.2%,
    at the same peak memory; where the first plan is already the best (m=16) it is kept."""
    busy = Fr(3624, 10)
    for m, single, best in ((8, Fr(2062, 5), Fr(3813, 10)), (16, Fr(7437, 10), Fr(7437, 10))):
        one, chosen = zb_v(4, m, costs=MEASURED_PP4, tries=1), zb_v(4, m, costs=MEASURED_PP4)
        check_schedule(chosen, 4, m, 2, "v")
        got, first = (
            simulate(chosen, 4, 2, **at(MEASURED_PP4)),
            simulate(one, 4, 2, **at(MEASURED_PP4)),
        )
        assert (first.makespan, got.makespan) == (single, best)
        assert (
            max(got.busy) == busy * m / 8
            and got.peak_unfinished == first.peak_unfinished == (8,) * 4
        )
    assert zb_v(4, 8, costs=MEASURED_PP4) == zb_v(
        4, 8, costs=MEASURED_PP4
    )  # seeded: every rank plans the same


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
def test_zb_v_plans_any_costs_without_stalling(p):
    """Random costs (zero F, BI or BW included; the first stage's BI is empty): every list is valid and keeps at most
    2p chunk-forwards awaiting BW. A chunk-0 forward never takes a rank's last place unless a chunk-1 forward
    is held; without that rule p=2 with MEASURED's costs stalls after four stage-0 forwards on rank 0."""
    rng = random.Random(p)
    for _ in range(40):
        costs = {
            k: [
                rng.choice([0, 1, 2, 3, 5] if k == "F" else [0, 1, 2, 3, 5, 8])
                for _ in range(2 * p)
            ]
            for k in ("F", "BI", "BW")
        }
        for m in (1, p, 2 * p + 1):
            for lists in (zb_v(p, m, costs=costs, tries=1), zb_v(p, m, costs=costs)):
                check_schedule(lists, p, m, 2, "v")
                assert max(simulate(lists, p, 2, **at(costs)).peak_unfinished) <= 2 * p


def test_costs_are_checked_and_only_zb_v_takes_them():
    with pytest.raises(
        ValueError, match=r"zb-v costs\['BI'\] needs 4 finite non-negative values .* got \[1, 1\]"
    ):
        zb_v(2, 4, costs={"F": [1] * 4, "BI": [1, 1], "BW": [1] * 4})
    with pytest.raises(
        ValueError, match=r"zb-v costs\['F'\] needs 4 finite non-negative values .* got \[1, nan"
    ):
        zb_v(2, 4, costs={"F": [1, float("nan"), 1, 1], "BI": [1] * 4, "BW": [1] * 4})
    with pytest.raises(ValueError, match="schedule '1f1b' is a fixed order and takes no costs"):
        get_schedule("1f1b", 2, 4, 1, costs=MEASURED)
    chunks = build_stage_modules(helpers.tiny("gpt2", num_layers=2), None, seed=0)
    with pytest.raises(
        ValueError, match="schedule_costs='measure' with schedule '1f1b': only 'zb-v' plans"
    ):
        PipelineParallel(chunks, None, "1f1b", 4, schedule_costs="measure")
    with pytest.raises(ConfigError, match="schedule_costs 'measure' plans schedule 'zb-v' only"):
        PipelineConfig(size=2, schedule="zb-h1", schedule_costs="measure")
    pipe = PipelineParallel(
        build_stage_modules(helpers.tiny("gpt2", num_layers=2), None, v=2, seed=0, schedule="zb-v"),
        None,
        "zb-v",
        4,
    )
    config = dict(
        ds_config("zb-v"),
        pipeline={"size": 1, "schedule": "zb-v", "virtual_stages": 2, "schedule_costs": "measure"},
    )
    with pytest.raises(
        ConfigError,
        match="pipeline.schedule_costs 'measure' but the PipelineParallel was built "
        "with schedule_costs=None; pass schedule_costs='measure'",
    ):
        plait.initialize(pipe, config)


def test_stage_costs_reads_medians_per_virtual_stage_and_simulate_takes_them():
    """Rank 0 holds stages 0 and 3 under "v", rank 1 stages 1 and 2; a per-rank cost sequence is the same
    as the per-stage one it expands to."""
    timelines = [
        [
            {"kind": "F", "chunk": 0, "start": 0.0, "end": 1.0},
            {"kind": "F", "chunk": 0, "start": 1.0, "end": 4.0},
            {"kind": "F", "chunk": 0, "start": 4.0, "end": 6.0},
            {"kind": "BW", "chunk": 1, "start": 6.0, "end": 6.5},
        ],
        [ActionTime("F", 0, 1, 0.0, 0.25, 0.1), ActionTime("BI", 0, 0, 1.0, 3.0, 0.1)],
    ]
    assert stage_costs(timelines, 2, 2, "v") == {
        "F": [2.0, 0.0, 0.25, 0.0],
        "BI": [0.0, 2.0, 0.0, 0.0],
        "BW": [0.0, 0.0, 0.0, 0.5],
    }
    lists = zb_v(2, 4)
    per_rank = simulate(lists, 2, 2, cost_f=(1, 2), cost_bi=(3, 1), shape="v")
    per_stage = simulate(lists, 2, 2, cost_f=(1, 2, 2, 1), cost_bi=(3, 1, 1, 3), shape="v")
    assert per_rank.timeline == per_stage.timeline
    with pytest.raises(
        ValueError,
        match=r"cost of F: 3 values; give one, one per rank \(p=2\) or one per "
        r"virtual stage \(p\*v=4\)",
    ):
        simulate(lists, 2, 2, cost_f=(1, 2, 3), shape="v")
    with pytest.raises(
        ValueError, match=r"cost of BI: \[1, -1\] has a value that is not finite and >= 0"
    ):
        simulate(lists, 2, 2, cost_bi=(1, -1), shape="v")


def ds_config(schedule: str) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 1},
        "pipeline": {
            "size": 2,
            "schedule": schedule,
            "virtual_stages": 2 if schedule == "zb-v" else 1,
        },
    }


def train_zero1(schedule: str, costs: dict | str | None = None) -> tuple:
    """Three ZeRO-1 steps of a tied GPT-2 at pp=2 x dp=2: the losses, this rank's parameters by name and the
    lists of the last step with the costs they were planned for."""
    mesh = ParallelMesh(tp=1, pp=2)
    chunks = build_stage_modules(
        helpers.tiny("gpt2", num_layers=4),
        mesh,
        v=2 if schedule == "zb-v" else 1,
        seed=5,
        schedule=schedule,
    )
    pipe = PipelineParallel(chunks, mesh, schedule, micro_batches=4, schedule_costs=costs)
    engine = plait.initialize(pipe, ds_config(schedule), mesh=mesh)
    losses = [
        engine.train_batch(
            iter([helpers.micro_batch(step, g, mesh.dp_rank, micro=2, seq=8) for g in range(4)])
        ).item()
        for step in range(3)
    ]
    return (
        losses,
        {n: t.detach().clone() for chunk in chunks for n, t in chunk.named_parameters()},
        (pipe.lists, pipe.planned_costs, pipe.executor.time_compute),
    )


def zero1_and_wrong_placement() -> tuple:
    ref, got, planned, measured = (
        train_zero1("1f1b"),
        train_zero1("zb-v"),
        train_zero1("zb-v", MEASURED),
        train_zero1("zb-v", "measure"),
    )
    mesh = ParallelMesh(tp=1, pp=2)
    loop_chunks = build_stage_modules(helpers.tiny("gpt2", num_layers=4), mesh, v=2, seed=5)
    try:
        PipelineParallel(loop_chunks, mesh, "zb-v", micro_batches=4)
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (ref, got, planned, measured))
    return out, refused


def test_zb_v_through_the_engine_with_zero1_and_chunks_of_another_placement_refused():
    """ZB-V, on unit costs, planned for MEASURED (another list) and planned for its own second step's times
    (schedule_costs="measure": the third step runs those lists), equals 1F1B to the last bit (each
    parameter's gradient sums its micro-batches in the same order; the tied copies, both on rank 0 here, are
    summed locally as over the 1F1B pair). The measured plan is the same on all four ranks (gathered over the
    world), and "loop" chunks under "zb-v" are refused by name before any step."""
    assert zb_v(2, 4, costs=MEASURED) != zb_v(2, 4)
    results = run_distributed(zero1_and_wrong_placement, 4)
    per_rank, refused = results[0]
    params = [{}, {}, {}, {}]
    for runs in per_rank:
        assert runs[0][0] == runs[1][0] == runs[2][0] == runs[3][0]  # the losses of three steps
        for run, into in zip(runs, params):
            into.update(run[1])
    for got in params[1:]:
        assert set(got) == set(params[0]) and all((got[n] == w).all() for n, w in params[0].items())
    lists, costs, timing = per_rank[0][3][2]
    assert timing is False  # the measured step's timing was switched off again
    assert set(costs) == {"F", "BI", "BW"} and all(
        len(c) == 4 and min(c) > 0 for c in costs.values()
    )
    assert lists == zb_v(2, 4, costs=costs) and all(
        runs[3][2] == (lists, costs, False) for runs in per_rank
    )
    assert per_rank[0][1][2] == (zb_v(2, 4), None, False)
    assert "stage 1 ends at layer 2 but stage 2 starts at layer 5 (placement 'v')" in refused
    assert all(r[1] == refused for r in results)
