"""CUDA-graphed pipeline actions (``plait.parallel.pipeline_graphs``): the parts that run on CPU.

The graphs themselves need a GPU: ``tests/gpu/run_pipeline_graphs.py`` checks graphed against eager steps
(1F1B, interleaved, ZB-H1, ZB-V; p = 1 and 2) on the device. Here: how many slots each list needs, the
refusals, and the BW split into kernels (captured) and accumulation (run after each replay).
"""
import pytest
import torch

from plait.layers.stages import build_stage_modules
from plait.parallel.pipeline import PipelineParallel
from plait.parallel.pipeline_backward import backward_input, backward_weight, run_tails, weight_gradients
from plait.parallel.pipeline_graphs import backward_kinds, slots_needed
from plait.parallel.schedules import Action, get_schedule, placement
from plait.parallel.simulate import simulate
from test_zb_split import assert_bitwise, model_case


@pytest.mark.parametrize("name, v, want", [
    ("gpipe", 1, [[4], [4]]),              # every forward before any backward: all m held
    ("1f1b", 1, [[2], [1]]),               # rank r warms up with p - r forwards
    ("zb-h1", 1, [[2], [2]]),              # rank 1: F0 BI0 F1 BI1 BW0 -- BW0 waits until after F1
    ("interleaved", 2, [[4, 2], [3, 1]]),
    ("zb-v", 2, [[3, 1], [3, 2]]),
])
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
    mixed = [Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("BI", 1, 0), Action("BW", 1, 0)]
    with pytest.raises(ValueError, match="both B and BI/BW"):
        backward_kinds(mixed, 1)


def test_cuda_graphs_on_cpu_is_refused_with_the_fix():
    from plait.layers import preset

    cfg = preset("llama-886m", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                 vocab_size=128, max_position_embeddings=16)
    chunks = build_stage_modules(cfg, None, v=1, seed=0)
    with pytest.raises(ValueError, match="CUDA device.*cuda_graphs=False"):
        PipelineParallel(chunks, None, schedule="1f1b", micro_batches=2, cuda_graphs=True)


@pytest.mark.parametrize("head", [False, True])
def test_bw_kernels_then_tails_equal_backward_weight_bitwise(head):
    """What a graph captures (``weight_gradients``) followed by ``run_tails`` after the replay leaves
    ``.grad`` bitwise as ``backward_weight`` does (float32 Llama stage; with the head: the loss)."""
    model, fn, x0, grad_out = model_case("llama", torch.float32, head)
    params = list(model.parameters())
    results = []
    for split in (backward_weight, lambda pending: run_tails(*weight_gradients(pending))):
        x = x0.clone().requires_grad_()
        gx, pending = backward_input(fn(x), grad_out, x)
        assert pending.split
        split(pending)
        results.append([gx] + [p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    assert_bitwise(results[0], results[1])


def test_config_key_and_its_refusals():
    from plait.config import ConfigError, load_config

    base = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4}
    cfg = load_config({**base, "pipeline": {"size": 2, "cuda_graphs": True}, "zero_optimization": {"stage": 1}})
    assert cfg.pipeline.cuda_graphs and not load_config(base).pipeline.cuda_graphs
    for extra, named in (({"zero_optimization": {"stage": 3}}, "got stage 3 and size 1"),
                         ({"tensor_parallel": {"size": 2}}, "got stage 0 and size 2")):
        with pytest.raises(ConfigError, match=named):
            load_config({**base, "pipeline": {"size": 2, "cuda_graphs": True}, **extra})
