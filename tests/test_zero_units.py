"""ZeRO-3 units of Hugging Face models and DeepSpeed's prefetch bound.

* An unmodified transformers Llama is gathered per decoder layer (the classes in its ``_no_split_modules``,
  FSDP's default wrapping), plus one unit per module with parameters outside them; before, every Linear was
  a unit of its own.
* ``prefetch_bucket_size`` bounds what is taken *before* each unit (DeepSpeed's rule, in whole units): a unit
  larger than the whole bucket is still prefetched, whole. With "auto" sizes (0.9 h^2) every Llama matrix is
  larger than the bucket, so the first rule (stop when the segment would pass the bound) never prefetched
  anything; the second (segments, not units) left the rest of a block larger than the bucket to a
  synchronous all-gather (llama-5.9b at dp=4: 37 ms more exposed communication per step than FSDP2).
  Prefetching moves no number: the single-process run still matches the reference (``zero_cases``' 1e-6).
"""

from __future__ import annotations

import transformers

from plait.engine.model import stage3_units
from plait.zero import CommOptions, ZeroOptimizer, weight_decay_groups
from zero_cases import (
    MICRO_BS,
    STEPS,
    assert_weights,
    build,
    full_weights,
    make_model,
    reference,
    train,
)


def tiny_llama():
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )


def test_a_hugging_face_llama_is_gathered_per_decoder_layer():
    model = tiny_llama()
    opt = ZeroOptimizer(
        model,
        None,
        stage=3,
        optimizer_kwargs={"lr": 1e-3},
        param_groups=weight_decay_groups(model, 0.0),
        units=stage3_units(model),
        comm=CommOptions(param_persistence_threshold=0),
    )
    assert [u.name for u in opt.units] == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]
    assert len(opt.units[1].params) == 9  # q, k, v, o, gate, up, down, two norms


def test_a_model_without_blocks_keeps_the_default_units():
    model = make_model()
    assert stage3_units(model) is None


def test_a_segment_larger_than_the_prefetch_bucket_is_prefetched_alone():
    cfg = dict(stage=3, gas=3, units="blocks", prefetch=1)  # every segment is larger than 1 element
    model = make_model()
    opt = build(model, cfg, None)
    train(model, opt, cfg, STEPS)
    assert opt.gatherer.stats["prefetched"] > 0
    assert_weights(
        full_weights(model, opt), reference(3 * MICRO_BS)[0], "stage 3, prefetch bucket 1"
    )


def test_every_unit_but_the_first_forward_one_is_prefetched_whole():
    """Blocks of 3 segments each (reduce bucket 200 elements), prefetch bound 1 element, 2 micro-steps per
    step: once the order is recorded, a step gathers synchronously only the root's 3 segments at each
    forward's start; the blocks are prefetched whole in forward and backward (the last block as the
    forward ends). Segment-granular prefetch gives 24 synchronous gathers a step, no prefetch at the
    forward's end 12."""
    cfg = dict(stage=3, gas=2, units="blocks", prefetch=1, bucket=200)
    model = make_model()
    opt = build(model, cfg, None)
    assert [len(u.segments) for u in opt.units] == [3, 3, 3], [u.name for u in opt.units]
    train(model, opt, cfg, 2)
    before = dict(opt.gatherer.stats)
    train(model, opt, cfg, 1)
    step = {k: opt.gatherer.stats[k] - before[k] for k in before}
    assert step == {
        "fetched": 2 * 3,
        "prefetched": 2 * 2 * 2 * 3,
        "prefetched_in_backward": 2 * 1 * 3,
    }, step
    train(model, opt, cfg, STEPS - 3)
    assert_weights(
        full_weights(model, opt), reference(2 * MICRO_BS)[0], "stage 3, units prefetched whole"
    )


def test_each_stage3_unit_has_its_own_master_and_gradient_shard():
    """One flat group per unit (and one for the persistent parameters): a unit's gradient shard is allocated
    when its gradients land and given back after the step, one unit at a time, so on CUDA it is given back
    without expandable segments; a whole-model shard (stages 1-2, or stage 3 with one unit) is not."""
    import torch

    from plait.zero.stage12 import gives_back

    model = tiny_llama()
    opt = ZeroOptimizer(
        model,
        None,
        stage=3,
        optimizer_kwargs={"lr": 1e-3},
        param_groups=weight_decay_groups(model, 0.0),
        units=stage3_units(model),
        comm=CommOptions(param_persistence_threshold=0),
    )
    units = [g.key.unit for g in opt.groups]  # a unit with norms has two (weight decay and none)
    assert sorted(set(units)) == [u.index for u in opt.units] and units == sorted(units)
    assert all(seg.unit == g.key.unit for g in opt.groups for seg in g.segments)
    assert len(opt.masters) == len(opt.grad_shards) == len(opt.groups)
    assert opt.reducer.give_back  # on CPU always; the rule for CUDA:
    cuda = torch.device("cuda")
    assert gives_back(cuda, False, per_unit=True) and not gives_back(cuda, True, per_unit=True)
    stage2 = ZeroOptimizer(tiny_llama(), None, stage=2, optimizer_kwargs={"lr": 1e-3})
    assert len(stage2.groups) == 1 and stage2.groups[0].key.unit is None
