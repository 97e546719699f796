"""An engine built without an optimizer (issue 42.5), as ``deepspeed.initialize`` builds one for evaluation,
inference or a frozen reference model: ZeRO shards and gathers the parameters as for training, forward passes
give the unsharded model's results, and ``backward``/``step`` raise naming the missing optimizer.

Tolerance: 0. The forward of a ZeRO-3 engine runs the same kernels on the same (gathered) fp32 weights as the
plain model, so on CPU the losses and logits are bitwise equal; a shard gathered in the wrong order, or a
weight left unloaded, changes them at the first digit.
"""

import pytest
import torch
import torch.distributed as dist
import transformers

import plait
import plait.deepspeed
from plait.config import ConfigError
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.testing import run_distributed
from helpers import micro_batch, tiny

ZERO3 = {
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _both_stages():
    return {stage: _losses(stage) for stage in (0, 3)}


def _losses(stage):
    mesh = ParallelMesh()
    plain = TransformerModel(tiny(), mesh, seed=5)
    with torch.no_grad():
        want = [float(plain(**micro_batch(s, 0, mesh.dp_rank))) for s in range(2)]
    engine = plait.initialize(
        TransformerModel(tiny(), mesh, seed=5),
        {**ZERO3, "zero_optimization": {**ZERO3["zero_optimization"], "stage": stage}},
        mesh=mesh,
    )
    sharded = stage == 3 and any(p.numel() == 0 for p in engine.module.parameters())
    with torch.no_grad():
        got = [float(engine(**micro_batch(s, 0, mesh.dp_rank))) for s in range(2)]
    evaluated = float(engine.eval_batch(iter([micro_batch(0, 0, mesh.dp_rank)])))
    return want, got, evaluated, sharded, dist.get_world_size()


@pytest.fixture(scope="module")
def dp2():
    """Per rank of a 2-rank run: {stage: (plain losses, engine losses, eval_batch loss, sharded?, world)}."""
    return run_distributed(_both_stages, 2)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_forward_only_engine_computes_the_plain_models_losses_at_dp_2(dp2, stage):
    ranks = [r[stage] for r in dp2]
    for want, got, evaluated, sharded, world in ranks:
        assert got == want and world == 2
        assert sharded == (stage == 3)  # ZeRO-3: each rank holds only its shards between uses
    # eval_batch: the mean over the dp ranks of their first micro-batch's loss
    assert ranks[0][2] == pytest.approx(sum(r[0][0] for r in ranks) / 2, rel=1e-6)


def test_a_hugging_face_model_under_zero_3_forward_only_gives_the_plain_logits():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = plain(input_ids=ids).logits
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(plain.state_dict())
    started = not dist.is_initialized()
    try:  # deepspeed.initialize starts a one-rank group, as DeepSpeed does: left to the next test, it would leak
        engine, optimizer, _, scheduler = plait.deepspeed.initialize(
            model=model, config_params=ZERO3
        )
        assert engine.forward_only and scheduler is None
        with torch.no_grad():
            assert torch.equal(engine(input_ids=ids).logits, want)
    finally:
        if started and dist.is_initialized():
            dist.destroy_process_group()


def test_backward_and_step_name_the_missing_optimizer():
    engine = plait.initialize(TransformerModel(tiny(), ParallelMesh(), seed=5), ZERO3)
    loss = engine(**micro_batch(0, 0, 0))
    for call in (
        lambda: engine.backward(loss),
        engine.step,
        lambda: engine.train_batch(iter([micro_batch(0, 0, 0)])),
    ):
        with pytest.raises(ConfigError, match=r"built without an optimizer .* add \"optimizer\""):
            call()
    with pytest.raises(ConfigError, match="offload_optimizer is set but there is no optimizer"):
        plait.initialize(
            TransformerModel(tiny(), ParallelMesh(), seed=5),
            {**ZERO3, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}},
        )
