"""A Hugging Face model built without its weights (``plait.zero.meta_parameters``) and filled by
``plait.initialize(..., weights=checkpoint_folder)``: DeepSpeed's ``zero.Init`` role. Under ZeRO-3 each of two
ranks reads only its shard of the sharded parameters from the safetensors files (plus the small persistent
ones whole), and the run equals the one that loaded the whole model with ``from_pretrained`` first, bit for
bit (the same float32 values land in the same flat layout; nothing is rounded differently)."""

import pytest
import torch
import transformers

import plait
from plait.testing import run_distributed
from plait.zero import meta_parameters
from plait.zero.weights import SafetensorsWeights

CONFIG = transformers.LlamaConfig(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def ds_config(stage):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 100},
    }


def save_checkpoint(path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(CONFIG).save_pretrained(
        path, max_shard_size="40KB"
    )  # several files + index


def train(engine, rank):
    for step in range(3):
        ids = torch.randint(
            0, 128, (2, 9), generator=torch.Generator().manual_seed(10 * step + rank)
        )
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    with engine.gathered_parameters():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _body(path, stage):
    import torch.distributed as dist

    rank = dist.get_rank()
    whole = plait.initialize(transformers.LlamaForCausalLM.from_pretrained(path), ds_config(stage))
    with meta_parameters():
        empty = transformers.LlamaForCausalLM(CONFIG)
    on_meta = all(p.device.type == "meta" for p in empty.parameters())
    buffers_real = all(b.device.type != "meta" for b in empty.buffers())
    source = SafetensorsWeights(path)
    lazy = plait.initialize(empty, ds_config(stage), weights=source)
    return on_meta, buffers_real, source.elements_read, train(whole, rank), train(lazy, rank)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_built_without_weights_trains_as_the_loaded_one(stage, tmp_path):
    save_checkpoint(tmp_path)
    total = sum(p.numel() for p in transformers.LlamaForCausalLM(CONFIG).parameters())
    results = run_distributed(_body, 2, str(tmp_path), stage)
    for on_meta, buffers_real, read, whole, lazy in results:
        assert on_meta and buffers_real
        assert all(torch.equal(whole[n], lazy[n]) for n in whole)
        if (
            stage == 3
        ):  # its own half of the sharded parameters, and the persistent (< 100 elements) whole
            assert read < 0.55 * total
        else:
            assert read == total
    if stage == 3:  # together the two ranks read each sharded element once
        assert sum(r[2] for r in results) < 1.1 * total


def test_meta_parameters_need_weights_and_weights_need_meta_parameters(tmp_path):
    with meta_parameters():
        empty = transformers.LlamaForCausalLM(CONFIG)
    with pytest.raises(ValueError, match="pass weights="):
        plait.initialize(empty, ds_config(3))
    with pytest.raises(ValueError, match="drop weights="):
        plait.initialize(transformers.LlamaForCausalLM(CONFIG), ds_config(3), weights=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        SafetensorsWeights(tmp_path)


def test_a_parameter_missing_from_the_checkpoint_is_named(tmp_path):
    save_checkpoint(tmp_path)
    other = transformers.LlamaConfig(**{**CONFIG.to_dict(), "num_hidden_layers": 3})
    with meta_parameters():
        deeper = transformers.LlamaForCausalLM(other)
    with pytest.raises(KeyError, match="model.layers.2"):
        plait.initialize(deeper, ds_config(2), weights=str(tmp_path))


def test_a_frozen_parameter_is_read_and_a_shape_mismatch_named(tmp_path):
    save_checkpoint(tmp_path)
    with meta_parameters():
        model = transformers.LlamaForCausalLM(CONFIG)
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen: no optimizer lays it out
    engine = plait.initialize(model, ds_config(3), weights=str(tmp_path))
    want = transformers.LlamaForCausalLM.from_pretrained(tmp_path).model.embed_tokens.weight
    assert torch.equal(engine.module.model.embed_tokens.weight, want)
    wider = transformers.LlamaConfig(**{**CONFIG.to_dict(), "intermediate_size": 96})
    with meta_parameters():
        other = transformers.LlamaForCausalLM(wider)
    with pytest.raises(
        ValueError,
        match=r"'model.layers.0.mlp.gate_proj.weight' is \(96, 32\) in the model but "
        r"\(64, 32\) in the checkpoint",
    ):
        plait.initialize(other, ds_config(3), weights=str(tmp_path))
