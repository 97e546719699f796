"""CUDA-graphed pipeline actions (``plait.parallel.pipeline.graphs``): the parts that run on CPU.

The graphs themselves need a GPU: ``tests/gpu/run_pipeline_graphs.py`` checks graphed against eager steps
(1F1B, interleaved, ZB-H1, ZB-V; p = 1 and 2) on the device. Here: how many slots each list needs, the
refusals, and the BW split into kernels (captured) and accumulation (run after each replay).
"""

import pytest
import torch

from plait.layers.stages import build_stage_modules
from plait.parallel.pipeline.parallel import PipelineParallel
from plait.parallel.pipeline.backward import backward_input, run_tails, weight_gradients
from plait.parallel.pipeline.graphs import (
    backward_kinds,
    check_capturable,
    check_same_shapes,
    slots_needed,
)
from plait.parallel.pipeline.schedules import Action
from plait.parallel.pipeline.registry import get_schedule, placement
from plait.parallel.pipeline.simulate import simulate


@pytest.mark.parametrize(
    "name, v, want",
    [
        ("gpipe", 1, [[4], [4]]),  # every forward before any backward: all m held
        ("1f1b", 1, [[2], [1]]),  # rank r warms up with p - r forwards
        ("zb-h1", 1, [[2], [2]]),  # rank 1: F0 BI0 F1 BI1 BW0 -- BW0 waits until after F1
        ("interleaved", 2, [[4, 2], [3, 1]]),
        ("zb-v", 2, [[3, 1], [3, 2]]),
    ],
)
def test_slots_per_chunk_are_the_micro_batches_held_until_the_last_backward(name, v, want):
    lists = get_schedule(name, 2, 4, v)
    got = [slots_needed(actions, v) for actions in lists]
    assert got == want
    # a slot is held until B or BW; the simulator counts forwards held until B or BI, so never more
    peak = simulate(lists, 2, v, shape=placement(name)).peak_in_flight
    assert all(sum(slots) >= held for slots, held in zip(got, peak))


def test_zb_h1_rank_1_list_as_the_slot_count_reads_it():
    kinds = [f"{a.kind}{a.microbatch}" for a in get_schedule("zb-h1", 2, 4, 1)[1]]
    assert kinds[:5] == ["F0", "BI0", "F1", "BI1", "BW0"]


def test_backward_kinds_and_a_list_mixing_b_with_the_split_is_refused():
    assert backward_kinds(get_schedule("1f1b", 2, 4, 1)[0], 1) == ["B"]
    assert backward_kinds(get_schedule("zb-v", 2, 4, 2)[0], 2) == ["BI/BW", "BI/BW"]
    mixed = [
        Action("F", 0, 0),
        Action("B", 0, 0),
        Action("F", 1, 0),
        Action("BI", 1, 0),
        Action("BW", 1, 0),
    ]
    with pytest.raises(ValueError, match="both B and BI/BW"):
        backward_kinds(mixed, 1)


def test_cuda_graphs_on_cpu_is_refused_with_the_fix():
    from plait.models import preset

    cfg = preset(
        "llama-886m",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=96,
        vocab_size=128,
        max_position_embeddings=16,
    )
    chunks = build_stage_modules(cfg, None, v=1, seed=0)
    with pytest.raises(ValueError, match="CUDA device.*cuda_graphs=False"):
        PipelineParallel(chunks, None, schedule="1f1b", micro_batches=2, cuda_graphs=True)


def test_tails_run_again_at_every_replay_only_when_kept():
    """A graph replays BW's kernels and then runs the same tail nodes again. A weight used as ``(w * s).t()``
    leaves a ``MulBackward0`` tail (saved tensors w and s): kept, a second run adds the same gradients again;
    not kept, torch refuses the second run (what replays did before ``keep_graph``)."""
    g = torch.Generator().manual_seed(0)
    w, s = (
        torch.randn(6, 5, generator=g, requires_grad=True),
        torch.randn(6, 5, generator=g, requires_grad=True),
    )
    x = torch.randn(3, 5, generator=g, requires_grad=True)
    for keep in (True, False):
        w.grad = s.grad = None
        gx, pending = backward_input(torch.tanh(x @ (w * s).t()).sum(), None, x)
        assert pending.split
        tails = weight_gradients(pending)
        run_tails(*tails, keep_graph=keep)
        once = (w.grad.clone(), s.grad.clone())
        if not keep:
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                run_tails(*tails)
            continue
        run_tails(*tails, keep_graph=True)
        assert torch.equal(w.grad, 2 * once[0]) and torch.equal(s.grad, 2 * once[1])
    w.grad = s.grad = None
    torch.tanh(
        x.detach() @ (w * s).t()
    ).sum().backward()  # one plain backward: what one run must add
    assert torch.equal(once[0], w.grad) and torch.equal(once[1], s.grad)


def test_micro_batches_of_other_keys_or_shapes_are_refused():
    ids = torch.zeros(2, 8, dtype=torch.long)
    check_same_shapes([{"input_ids": ids, "labels": ids}] * 3)
    for other, named in (
        ({"input_ids": ids[:, :4], "labels": ids[:, :4]}, r"\(2, 4\)"),
        ({"input_ids": ids, "labels": ids, "attention_mask": ids}, "attention_mask"),
        ({"input_ids": ids.int(), "labels": ids}, "int32"),
    ):
        with pytest.raises(ValueError, match=f"micro-batch 1 has .*{named}.*same keys"):
            check_same_shapes([{"input_ids": ids, "labels": ids}, other])


def test_what_a_capture_cannot_replay_is_refused_by_name():
    from plait.models import preset

    def chunk(**kw):
        cfg = preset(
            "llama-886m",
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=96,
            vocab_size=128,
            max_position_embeddings=16,
            **kw,
        )
        return build_stage_modules(cfg, None, v=1, seed=0)[0]

    check_capturable([chunk()])
    hooked = chunk()
    hooked.layers["1"].register_forward_pre_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"module layers\.1 has module hooks .*ZeRO stage 0-2"):
        check_capturable([hooked])
    graded = chunk()
    next(graded.parameters()).register_hook(lambda g: g)
    with pytest.raises(ValueError, match="gradient hook .*register_post_accumulate_grad_hook"):
        check_capturable([graded])
    dropped = chunk(hidden_dropout=0.1)
    with pytest.raises(ValueError, match="dropout 0.1"):
        check_capturable([dropped])
    check_capturable([dropped.eval()])


def test_config_key_and_its_refusals():
    from plait.config import ConfigError, load_config

    base = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 4,
    }
    cfg = load_config(
        {**base, "pipeline": {"size": 2, "cuda_graphs": True}, "zero_optimization": {"stage": 1}}
    )
    assert cfg.pipeline.cuda_graphs and not load_config(base).pipeline.cuda_graphs
    for extra, named in (
        ({"zero_optimization": {"stage": 3}}, "got stage 3 and size 1"),
        ({"tensor_parallel": {"size": 2}}, "got stage 0 and size 2"),
    ):
        with pytest.raises(ConfigError, match=named):
            load_config({**base, "pipeline": {"size": 2, "cuda_graphs": True}, **extra})
