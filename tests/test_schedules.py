"""Pipeline schedules as data: exact bubble ratios, memory peaks, validation and deadlock checks.

Cost model in these tests (stated per test): F = 1, B = 2 with the split BI = BW = 1, i.e. the
paper convention T_B = 2 T_F (Narayanan et al.) and T_F = T_BI = T_BW (Qi et al., ZB-H1). Costs
are Fractions so bubble ratios compare exactly.
"""

from fractions import Fraction as Fr

import pytest

from plait.parallel.pipeline.check import check_schedule
from plait.parallel.pipeline.registry import SCHEDULES, get_schedule
from plait.parallel.pipeline.schedules import (
    Action,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    rank_chunk_of,
    stage_of,
    zb_h1,
)
from plait.parallel.pipeline.simulate import DeadlockError, render, simulate

ONE = dict(cost_f=Fr(1), cost_b=Fr(2), cost_bi=Fr(1), cost_bw=Fr(1))
PM = [(p, m) for p in (2, 4, 8) for m in sorted({p, 2 * p, 16})]


def test_action_and_virtual_stage_mapping():
    assert Action("F", 3) == Action("F", 3, 0) and str(Action("BI", 2, 1)) == "BI2.1"
    assert hash(Action("B", 1)) == hash(Action("B", 1, 0))
    # Megatron's interleaved assignment: chunk c on rank r is virtual stage c*p + r.
    assert [stage_of(r, c, 4) for c in range(2) for r in range(4)] == list(range(8))
    assert [rank_chunk_of(s, 4) for s in (0, 5, 7)] == [(0, 0), (1, 1), (3, 1)]
    with pytest.raises(ValueError, match="'X' is not one of"):
        Action("X", 0)
    with pytest.raises(ValueError, match="microbatch=-1"):
        Action("F", -1)


def test_1f1b_exact_order_p3_m4():
    lists = one_f_one_b(3, 4)
    order = [" ".join(map(str, acts)) for acts in lists]
    assert order == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


@pytest.mark.parametrize("p,m", PM)
def test_1f1b_and_gpipe_bubble_is_p_minus_1_over_m(p, m):
    for fn in (one_f_one_b, gpipe):
        lists = fn(p, m)
        check_schedule(lists, p, m)
        res = simulate(lists, p, **ONE)
        # Every rank: busy 3m, idle 3(p-1), makespan 3(m+p-1).
        assert res.makespan == 3 * (m + p - 1)
        assert res.busy == (3 * m,) * p and res.idle == (3 * (p - 1),) * p
        assert res.bubble_ratio == (Fr(p - 1, m),) * p
    assert simulate(one_f_one_b(p, m), p).peak_in_flight == tuple(min(p - r, m) for r in range(p))
    assert simulate(gpipe(p, m), p).peak_in_flight == (m,) * p


def test_bubble_ratio_also_holds_with_equal_f_and_b_costs():
    res = simulate(one_f_one_b(4, 8), 4, cost_f=1.0, cost_b=1.0)
    assert res.makespan == 2 * (8 + 4 - 1) and res.bubble_ratio == (3 / 8,) * 4


@pytest.mark.parametrize("p,m", PM)
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, m, v):
    lists = interleaved_1f1b(p, m, v)
    check_schedule(lists, p, m, v)
    # A chunk is 1/v of a stage, so each chunk's F/B cost 1/v, 2/v of the whole stage's.
    res = simulate(lists, p, v, cost_f=Fr(1, v), cost_b=Fr(2, v))
    assert res.busy == (3 * m,) * p
    assert res.bubble_ratio == (Fr(p - 1, v * m),) * p
    assert res.makespan == 3 * m + Fr(3 * (p - 1), v)
    # Activations held, in chunks: Megatron's warm-up (p-r-1)*2 + (v-1)*p plus one, capped at m*v.
    assert res.peak_in_flight == tuple(
        min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)
    )


def test_interleaved_first_rank_order_p2_m4_v2():
    assert " ".join(map(str, interleaved_1f1b(2, 4, 2)[0])) == (
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3"
    )


@pytest.mark.parametrize("p,m", PM)
def test_zb_h1_third_of_1f1b_bubble_same_activation_peak(p, m):
    lists = zb_h1(p, m)
    check_schedule(lists, p, m)
    zb, ref = simulate(lists, p, **ONE), simulate(one_f_one_b(p, m), p, **ONE)
    # Qi et al. 2024 Sec. 2.1: bubble (p-1)(T_F + T_B - T_W) = (p-1) units vs 1F1B's 3(p-1).
    assert zb.idle == (p - 1,) * p and zb.makespan == 3 * m + p - 1
    assert zb.bubble_ratio == (Fr(p - 1, 3 * m),) * p
    assert all(z < o for z, o in zip(zb.bubble_ratio, ref.bubble_ratio))
    assert zb.peak_in_flight == ref.peak_in_flight == tuple(range(p, 0, -1))
    # Deferred BW: every rank has p micro-batches between F and BW ("same in-flight count").
    assert zb.peak_unfinished == (p,) * p


def test_zb_h1_exact_timeline_p4_m8():
    res = simulate(zb_h1(4, 8), 4, **ONE)
    assert render(res).splitlines() == [
        "rank 0: F0 F1 F2 F3 .. .. .. I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7",
        "rank 1: .. F0 F1 F2 .. .. I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7",
        "rank 2: .. .. F0 F1 .. I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7",
        "rank 3: .. .. .. F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7",
    ]


def test_m_below_p_falls_back_to_clamped_warm_up():
    # 1F1B/ZB-H1 with m < p: warm-up clamped to m; still valid, mostly bubble.
    res = simulate(one_f_one_b(4, 2), 4, **ONE)
    assert res.bubble_ratio == (Fr(3, 2),) * 4 and res.peak_in_flight == (2, 2, 2, 1)
    check_schedule(zb_h1(4, 2), 4, 2)
    assert simulate(zb_h1(4, 2), 4, **ONE).makespan == 11


def test_timeline_with_comm_latency():
    # p=2, m=1, comm 0.5: F0 [0,1] -> F0 [1.5,2.5] -> B0 [2.5,4.5] -> B0 [5,7].
    res = simulate(one_f_one_b(2, 1), 2, cost_comm=0.5)
    assert [(t.start, t.end) for t in res.timeline[0]] == [(0, 1), (5, 7)]
    assert [(t.start, t.end) for t in res.timeline[1]] == [(1.5, 2.5), (2.5, 4.5)]
    assert res.makespan == 7 and res.idle == (4, 4)


def test_registry_and_get_schedule_errors():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"}
    assert get_schedule("1f1b", 4, 8) == one_f_one_b(4, 8)
    assert get_schedule("interleaved", 4, 8, 2) == interleaved_1f1b(4, 8, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zbh1'; did you mean 'zb-h1'"):
        get_schedule("zbh1", 4, 8)
    with pytest.raises(
        ValueError,
        match=r"'1f1b' runs one model chunk per rank but got v=2; "
        r"use schedule 'interleaved'",
    ):
        get_schedule("1f1b", 4, 8, 2)
    for m in (6, 3):  # interleaved takes any m >= 1 (no longer only multiples of p)
        assert get_schedule("interleaved", 4, m, 2) == interleaved_1f1b(4, m, 2)
        check_schedule(get_schedule("interleaved", 4, m, 2), 4, m, 2)
    with pytest.raises(ValueError, match="needs v >= 2 .* got v=1"):
        get_schedule("interleaved", 4, 8, 1)
    with pytest.raises(ValueError, match=r"m \(micro-batches\) must be a positive integer, got 0"):
        get_schedule("gpipe", 4, 0)


def test_check_schedule_catches_malformed_lists():
    good = one_f_one_b(2, 2)
    check_schedule(good, 2, 2)
    with pytest.raises(ValueError, match="schedule has 1 rank lists but p=2"):
        check_schedule(good[:1], 2, 2)
    missing = [good[0], [a for a in good[1] if a != Action("B", 1)]]
    with pytest.raises(
        ValueError, match=r"micro-batch 1, stage 1 \(rank 1, chunk 0\) has no backward"
    ):
        check_schedule(missing, 2, 2)
    swapped = [good[0], [Action("B", 0), Action("F", 0), Action("F", 1), Action("B", 1)]]
    with pytest.raises(ValueError, match=r"rank 1, action #0 \(B0\): backward before its forward"):
        check_schedule(swapped, 2, 2)
    dup = [good[0] + [Action("F", 0)], good[1]]
    with pytest.raises(ValueError, match=r"rank 0, action #4 \(F0\): duplicate"):
        check_schedule(dup, 2, 2)
    with pytest.raises(ValueError, match="micro-batch must be < m=1"):
        check_schedule(good, 2, 1)
    bw_first = [[Action("F", 0), Action("BW", 0), Action("BI", 0)]]
    with pytest.raises(ValueError, match="BW before its BI"):
        check_schedule(bw_first, 1, 1)
    mixed = [[Action("F", 0), Action("BI", 0), Action("B", 0), Action("BW", 0)]]
    with pytest.raises(ValueError, match="mixes B with BI/BW"):
        check_schedule(mixed, 1, 1)
    half = [[Action("F", 0), Action("BI", 0)]]
    with pytest.raises(ValueError, match="BI without BW"):
        check_schedule(half, 1, 1)


def test_cross_rank_deadlock_is_reported():
    # Locally valid, but rank 0 waits for B0 from rank 1, which first needs F1 from rank 0.
    lists = [
        [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
        [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)],
    ]
    check_schedule(lists, 2, 2)
    with pytest.raises(
        DeadlockError,
        match=r"rank 0 at step #1: B0 waits for BI of micro-batch 0 "
        r"at stage 1; rank 1 at step #0: F1 waits for F",
    ):
        simulate(lists, 2)


def test_render_1f1b_p2_m2():
    assert render(simulate(one_f_one_b(2, 2), 2)) == (
        "rank 0: F0 F1 .. .. B0 B0 .. B1 B1\nrank 1: .. F0 B0 B0 F1 B1 B1 .. .."
    )


# ---- interleaved 1F1B with any m (rounds of g >= p micro-batches) -----------------------------------


def _old_interleaved(p, m, v):
    """Copy of interleaved_1f1b before it took any m (groups of exactly p; needed p | m), as strings."""

    def order(k, backward):
        group, pos = divmod(k, p * v)
        chunk = v - 1 - pos // p if backward else pos // p
        return group * p + pos % p, chunk

    out = []
    for r in range(p):
        w = min((p - r - 1) * 2 + (v - 1) * p, m * v)
        fwd = [Action("F", *order(k, False)) for k in range(m * v)]
        bwd = [Action("B", *order(k, True)) for k in range(m * v)]
        acts = (
            fwd[:w] + [a for i in range(m * v - w) for a in (fwd[w + i], bwd[i])] + bwd[m * v - w :]
        )
        out.append(" ".join(map(str, acts)))
    return out


def test_interleaved_unchanged_for_multiples_of_p():
    # Lists printed by the code before this change (groups of exactly p), stored verbatim.
    before = {
        (3, 3, 2): [
            "F0 F1 F2 F0.1 F1.1 F2.1 B0.1 B1.1 B2.1 B0 B1 B2",
            "F0 F1 F2 F0.1 F1.1 F2.1 B0.1 B1.1 B2.1 B0 B1 B2",
            "F0 F1 F2 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 B0 B1 B2",
        ],
        (2, 4, 3): [
            "F0 F1 F0.1 F1.1 F0.2 F1.2 F2 B0.2 F3 B1.2 F2.1 B0.1 F3.1 B1.1 F2.2 B0 F3.2 B1 B2.2 B3.2 "
            "B2.1 B3.1 B2 B3",
            "F0 F1 F0.1 F1.1 F0.2 B0.2 F1.2 B1.2 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 F2.2 B2.2 F3.2 B3.2 "
            "B2.1 B3.1 B2 B3",
        ],
        (3, 6, 2): [
            "F0 F1 F2 F0.1 F1.1 F2.1 F3 F4 B0.1 F5 B1.1 F3.1 B2.1 F4.1 B0 F5.1 B1 B2 B3.1 B4.1 B5.1 B3 B4 B5",
            "F0 F1 F2 F0.1 F1.1 F2.1 B0.1 F3 B1.1 F4 B2.1 F5 B0 F3.1 B1 F4.1 B2 F5.1 B3.1 B4.1 B5.1 B3 B4 B5",
            "F0 F1 F2 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3 B0 F4 B1 F5 B2 F3.1 B3.1 F4.1 B4.1 F5.1 B5.1 B3 B4 B5",
        ],
    }
    for (p, m, v), want in before.items():
        assert [" ".join(map(str, acts)) for acts in interleaved_1f1b(p, m, v)] == want, (p, m, v)
        assert _old_interleaved(p, m, v) == want
    for p in range(1, 6):
        for v in (2, 3, 4):
            for m in (p, 2 * p, 3 * p, 4 * p):
                assert [
                    " ".join(map(str, a)) for a in interleaved_1f1b(p, m, v)
                ] == _old_interleaved(p, m, v)


def test_interleaved_rounds_for_m_not_a_multiple_of_p():
    # p=3, m=7: rounds of 3 and 4 micro-batches (larger last); warm-up (p-r-1)*2 + (v-1)*4.
    assert [" ".join(map(str, acts)) for acts in interleaved_1f1b(3, 7, 2)] == [
        "F0 F1 F2 F0.1 F1.1 F2.1 F3 F4 F5 B0.1 F6 B1.1 F3.1 B2.1 F4.1 B0 F5.1 B1 F6.1 B2 B3.1 B4.1 B5.1 B6.1 "
        "B3 B4 B5 B6",
        "F0 F1 F2 F0.1 F1.1 F2.1 F3 B0.1 F4 B1.1 F5 B2.1 F6 B0 F3.1 B1 F4.1 B2 F5.1 B3.1 F6.1 B4.1 B5.1 B6.1 "
        "B3 B4 B5 B6",
        "F0 F1 F2 F0.1 F1.1 B0.1 F2.1 B1.1 F3 B2.1 F4 B0 F5 B1 F6 B2 F3.1 B3.1 F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 "
        "B3 B4 B5 B6",
    ]
    # m < p: one round of m (here p=3, m=2).
    assert " ".join(map(str, interleaved_1f1b(3, 2, 2)[2])) == "F0 F1 F0.1 B0.1 F1.1 B1.1 B0 B1"


def _rounds_largest(p, m):
    """Largest round: max(m // p, 1) rounds of sizes as equal as possible."""
    return -(-m // max(m // p, 1))


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_interleaved_any_m_valid_deadlock_free_and_bubble(p):
    """Every m in 1..3p+1 and v in 2..4: complete, locally ordered, no deadlock compute-only nor with the
    communication of with_communication; bubble and activation peaks as derived below."""
    from plait.parallel.pipeline.comm_actions import with_communication

    for v in (2, 3, 4):
        for m in range(1, 3 * p + 2):
            lists = interleaved_1f1b(p, m, v)
            check_schedule(lists, p, m, v)
            res = simulate(lists, p, v, cost_f=Fr(1), cost_b=Fr(2))  # raises DeadlockError
            comm = with_communication(lists, p, v)
            check_schedule(comm, p, m, v)
            simulate(comm, p, v)  # raises DeadlockError
            # Bubble, per-chunk costs F = 1, B = 2, no comm latency. Every rank is busy 3mv (mv chunk-forwards
            # and as many chunk-backwards). Rank p-1 cannot start before micro-batch 0 has crossed chunk 0 of
            # ranks 0..p-2 (p-1 forwards), and after its last action, B of micro-batch m-1 on chunk 0, stages
            # p-2..0 still run that backward (p-1 backwards): makespan >= 3mv + 3(p-1). For m >= p the
            # rounds hold g >= p micro-batches: a micro-batch comes back to rank 0 for chunk c+1 p forward
            # slots after it left for chunk c, and the round keeps rank 0 busy for g >= p slots meanwhile
            # (backwards likewise, reversed), and the warm-up (v-1)*G + 2(p-r-1) (G the largest round) has
            # each round's first backward ready in time, so rank p-1 never waits in between and the bound
            # is met: idle 3(p-1) on every rank, ratio (p-1)/(v m), the paper's (p-1)(t_f + t_b)/v with
            # whole-stage t_f = v, t_b = 2v. For m < p (one round of m) each of the v-1 chunk changes waits
            # p-m forward slots and, in the backward, p-m backward slots: + 3(v-1)(p-m).
            idle = 3 * (p - 1) + 3 * (v - 1) * max(p - m, 0)
            assert res.busy == (3 * m * v,) * p and res.idle == (idle,) * p, (p, v, m, res.idle)
            assert res.bubble_ratio == (Fr(idle, 3 * m * v),) * p
            if m >= p:
                assert res.bubble_ratio == (Fr(p - 1, v * m),) * p
            g = _rounds_largest(
                p, m
            )  # activations held (chunks): the warm-up plus one, capped at mv
            assert res.peak_in_flight == tuple(
                min(2 * (p - r - 1) + (v - 1) * g + 1, m * v) for r in range(p)
            )
