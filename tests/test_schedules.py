"""Pipeline schedules as data: exact bubble ratios, memory peaks, validation and deadlock checks.

Cost model in these tests (stated per test): F = 1, B = 2 with the split BI = BW = 1, i.e. the
paper convention T_B = 2 T_F (Narayanan et al.) and T_F = T_BI = T_BW (Qi et al., ZB-H1). Costs
are Fractions so bubble ratios compare exactly.
"""
from fractions import Fraction as Fr

import pytest

from plait.parallel.schedules import (SCHEDULES, Action, check_schedule, get_schedule, gpipe,
                                      interleaved_1f1b, one_f_one_b, rank_chunk_of, stage_of, zb_h1)
from plait.parallel.simulate import DeadlockError, render, simulate, with_communication

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
    assert order == ["F0 F1 F2 B0 F3 B1 B2 B3",
                     "F0 F1 B0 F2 B1 F3 B2 B3",
                     "F0 B0 F1 B1 F2 B2 F3 B3"]


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
    assert res.peak_in_flight == tuple(min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p))


def test_interleaved_first_rank_order_p2_m4_v2():
    assert " ".join(map(str, interleaved_1f1b(2, 4, 2)[0])) == (
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3")


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
        "rank 3: .. .. .. F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7"]


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
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved", "zb-h1"}
    assert get_schedule("1f1b", 4, 8) == one_f_one_b(4, 8)
    assert get_schedule("interleaved", 4, 8, 2) == interleaved_1f1b(4, 8, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zbh1'; did you mean 'zb-h1'"):
        get_schedule("zbh1", 4, 8)
    with pytest.raises(ValueError, match=r"'1f1b' runs one model chunk per rank but got v=2; "
                                         r"use schedule 'interleaved'"):
        get_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match=r"multiple of p .*got m=6, p=4; use m=4 or 8"):
        get_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match=r"got m=3, p=4; use m=4,"):
        get_schedule("interleaved", 4, 3, 2)
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
    with pytest.raises(ValueError, match=r"micro-batch 1, stage 1 \(rank 1, chunk 0\) has no backward"):
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
    lists = [[Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)],
             [Action("F", 1), Action("B", 1), Action("F", 0), Action("B", 0)]]
    check_schedule(lists, 2, 2)
    with pytest.raises(DeadlockError, match=r"rank 0 at step #1: B0 waits for BI of micro-batch 0 "
                                            r"at stage 1; rank 1 at step #0: F1 waits for F"):
        simulate(lists, 2)


def test_with_communication_places_recv_before_and_send_after():
    lists = with_communication(one_f_one_b(2, 2), 2)
    assert [" ".join(map(str, acts)) for acts in lists] == [
        "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1",
        "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1"]
    check_schedule(lists, 2, 2)
    assert with_communication(interleaved_1f1b(1, 2, 2), 1, 2) == interleaved_1f1b(1, 2, 2)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2),
                                    ("interleaved", 3)])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_communication_never_deadlocks_under_rendezvous(name, v, p):
    for m in range(1, 2 * p + 2):
        if name == "interleaved" and m % p:
            continue
        lists = with_communication(get_schedule(name, p, m, v), p, v)
        check_schedule(lists, p, m, v)
        res = simulate(lists, p, v)  # raises DeadlockError if any batch could wait forever
        assert sum(len(tl) for tl in res.timeline) == sum(a.is_compute for acts in lists for a in acts)


def test_rendezvous_catches_send_right_after_producer():
    # The naive rule (send right after its producer) deadlocks interleaved 1F1B p=2, m=4, v=2.
    naive = []
    for r, acts in enumerate(interleaved_1f1b(2, 4, 2)):
        out = []
        for a in acts:
            s = stage_of(r, a.chunk, 2)
            out += [Action("RECV_F", a.microbatch, a.chunk)] if a.kind == "F" and s > 0 else []
            out += [Action("RECV_B", a.microbatch, a.chunk)] if a.kind == "B" and s < 3 else []
            out.append(a)
            out += [Action("SEND_F", a.microbatch, a.chunk)] if a.kind == "F" and s < 3 else []
            out += [Action("SEND_B", a.microbatch, a.chunk)] if a.kind == "B" and s > 0 else []
        naive.append(out)
    check_schedule(naive, 2, 4, 2)
    with pytest.raises(DeadlockError, match="comm batch"):
        simulate(naive, 2, 2)


def test_render_1f1b_p2_m2():
    assert render(simulate(one_f_one_b(2, 2), 2)) == (
        "rank 0: F0 F1 .. .. B0 B0 .. B1 B1\n"
        "rank 1: .. F0 B0 B0 F1 B1 B1 .. ..")
