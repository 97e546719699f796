"""Unmodified Hugging Face models through the engine: a checkpoint taken mid-run resumes exactly (ZeRO-2 and
ZeRO-3, 1 and 2 ranks, CPU/gloo, float32). Under ZeRO-3 a parameter's data is released between uses; the
checkpoint must still know its shape (it once failed with "flat range [0, n) is outside [0, 0]")."""

import tempfile

import pytest
import torch
import transformers

import plait
from plait.parallel import ParallelMesh
from plait.testing import run_distributed

STEPS, SAVE_AT = 5, 3


def hf_model(kind):
    torch.manual_seed(0)
    if kind == "llama":
        return transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
            )
        )
    return transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
        )
    )


def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    ids = torch.randint(0, 256, (2, 16), generator=g)
    return {"input_ids": ids, "labels": ids}


def run(kind, stage, steps, start=0, load=None, save=None):
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1000},
    }
    mesh = ParallelMesh()
    engine = plait.initialize(hf_model(kind), ds, mesh=mesh)
    if load:
        engine.load_checkpoint(load)
    losses = []
    for step in range(start, start + steps):
        loss = engine(**batch(step, mesh.dp_rank)).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    if save:
        engine.save_checkpoint(save)
    with engine.optimizer.gathered_parameters():
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return losses, weights


def _body(kind, stage, root):
    whole = run(kind, stage, STEPS)
    run(kind, stage, SAVE_AT, save=root)
    resumed = run(kind, stage, STEPS - SAVE_AT, start=SAVE_AT, load=root)
    return whole, resumed


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("kind,stage", [("llama", 3), ("bert", 3), ("llama", 2)])
def test_hf_model_resumes_exactly(kind, stage, world):
    with tempfile.TemporaryDirectory() as root:
        (want_losses, want), (got_losses, got) = run_distributed(
            _body, world, kind, stage, root, timeout_s=300
        )[0]
    assert got_losses == want_losses[SAVE_AT:]
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), name


def test_an_optimizer_instance_is_rebuilt_over_the_shards_with_its_settings():
    """A DeepSpeed script passes ``optimizer=torch.optim.AdamW(model.parameters(), ...)``; torch records
    ``decoupled_weight_decay`` in AdamW's defaults but its constructor refuses it back (a TypeError once)."""
    model = hf_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.05, betas=(0.8, 0.9))
    engine = plait.initialize(
        model, {"train_micro_batch_size_per_gpu": 2}, mesh=ParallelMesh(), optimizer=opt
    )
    inner = engine.optimizer.optimizer
    assert type(inner) is torch.optim.AdamW
    assert {(g["lr"], g["weight_decay"], g["betas"]) for g in inner.param_groups} == {
        (2e-3, 0.05, (0.8, 0.9))
    }
    loss = engine(**batch(0, 0)).loss
    engine.backward(loss)
    engine.step()
    assert engine.global_steps == 1
