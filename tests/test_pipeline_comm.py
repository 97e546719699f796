"""Placement of the pipeline's sends and receives (``comm_actions.with_communication``) and the simulator's
model of the executor's non-blocking transfers (``plait.parallel.pipeline.p2p``): sends right after their producer,
receives ahead of their reader in each channel's send order, no deadlock for any built-in schedule."""

import pytest

from plait.parallel.pipeline.check import check_schedule
from plait.parallel.pipeline.schedules import Action, interleaved_1f1b, one_f_one_b
from plait.parallel.pipeline.registry import get_schedule, placement
from plait.parallel.pipeline.simulate import DeadlockError, simulate
from plait.parallel.pipeline.comm_actions import with_communication


def _text(lists):
    return [" ".join(map(str, acts)) for acts in lists]


def test_sends_follow_their_producer_and_receives_precede_their_reader():
    # lookahead=1: each receive one compute action ahead of its reader
    assert _text(with_communication(one_f_one_b(2, 2), 2, lookahead=1)) == [
        "F0 SEND_F0 RECV_B0 F1 SEND_F1 RECV_B1 B0 B1",
        "RECV_F0 F0 RECV_F1 B0 SEND_B0 F1 B1 SEND_B1",
    ]
    # the default, lookahead=0: each receive right before its reader
    assert _text(with_communication(one_f_one_b(2, 2), 2)) == [
        "F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 RECV_B1 B1",
        "RECV_F0 F0 B0 SEND_B0 RECV_F1 F1 B1 SEND_B1",
    ]
    assert with_communication(interleaved_1f1b(1, 2, 2), 1, 2) == interleaved_1f1b(1, 2, 2)


@pytest.mark.parametrize(
    "name,v",
    [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2), ("interleaved", 3), ("zb-v", 2)],
)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_communication_never_deadlocks(name, v, p):
    shape = placement(name)
    for m in range(1, 2 * p + 2):  # every schedule takes any m >= 1 (m < p: mostly bubble)
        compute = get_schedule(name, p, m, v)
        for lookahead in (0, 1, 3):
            lists = with_communication(compute, p, v, lookahead=lookahead, shape=shape)
            check_schedule(lists, p, m, v, shape)
            res = simulate(
                lists, p, v, cost_comm=0.25, shape=shape
            )  # DeadlockError / ValueError on a bad list
            assert sum(len(tl) for tl in res.timeline) == sum(len(acts) for acts in compute)
            # Free transfers posted ahead cost nothing: the same makespan as the compute-only lists.
            assert (
                simulate(lists, p, v, shape=shape).makespan
                == simulate(compute, p, v, shape=shape).makespan
            )


def test_receives_out_of_channel_order_are_refused():
    lists = with_communication(one_f_one_b(2, 2), 2, lookahead=3)
    assert _text(lists)[1].startswith("RECV_F0 RECV_F1 F0")
    swapped = list(lists[1])
    i, j = swapped.index(Action("RECV_F", 0)), swapped.index(Action("RECV_F", 1))
    swapped[i], swapped[j] = Action("RECV_F", 1), Action("RECV_F", 0)  # rank 0 sends F0 first
    bad = [lists[0], swapped]
    check_schedule(bad, 2, 2)  # locally still fine: each RECV_F precedes its F
    with pytest.raises(ValueError, match=r"rank 1 posts its receives from rank 0 in the order"):
        simulate(bad, 2)


def test_a_cycle_through_the_transfers_is_reported_as_a_deadlock():
    # Rank 0 runs B0 before F1, rank 1 runs F1 before B0: rank 0 waits for the gradient of micro-batch 0,
    # which rank 1 sends only after F1, whose activation rank 0 sends only after B0.
    lists = [
        [
            Action("F", 0),
            Action("SEND_F", 0),
            Action("RECV_B", 0),
            Action("B", 0),
            Action("F", 1),
            Action("SEND_F", 1),
            Action("RECV_B", 1),
            Action("B", 1),
        ],
        [
            Action("RECV_F", 0),
            Action("F", 0),
            Action("RECV_F", 1),
            Action("F", 1),
            Action("B", 0),
            Action("SEND_B", 0),
            Action("B", 1),
            Action("SEND_B", 1),
        ],
    ]
    check_schedule(lists, 2, 2)
    with pytest.raises(
        DeadlockError, match=r"rank 1 at step #3: F1 waits for the activation of micro-batch 1"
    ):
        simulate(lists, 2)


def test_the_cyclic_garbage_collector_is_paused_during_a_step_only():
    import gc

    import torch

    from plait.models import preset
    from plait.layers.stages import build_stage_modules
    from plait.parallel.pipeline.parallel import PipelineParallel

    chunks = build_stage_modules(preset("llama-tiny", num_layers=2), None, v=2, seed=0)
    seen = []
    chunks[1].register_forward_pre_hook(lambda *_: seen.append(gc.isenabled()))
    pipe = PipelineParallel(chunks, None, schedule="interleaved", micro_batches=2)
    ids = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    assert gc.isenabled()
    pipe.train_batch([batch, batch])
    assert seen == [False, False] and gc.isenabled()
    gc.disable()  # a caller that turned it off itself keeps it off
    try:
        pipe.train_batch([batch, batch])
        assert not gc.isenabled()
    finally:
        gc.enable()
