"""ZeRO-3's float8 all-gather (``fp8.float8_all_gather``, ``plait.precision.float8_gather``) under torchao's CPU
emulation on 2 gloo ranks: the losses and weights equal those of the bf16 gather bit for bit, the float8 layers'
gathered bytes are halved (counted at the collective), and the refusals name the key."""

import glob
import os

import pytest
import torch

import plait
import plait.zero.comm as zero_comm
from plait.config import ConfigError, load_config
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.testing import run_distributed
from helpers import micro_batch, tiny

STEPS = 3


def ds_config(float8_all_gather: bool, **zero) -> dict:
    return {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        # threshold 0: every parameter of the tiny model is sharded and gathered
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
        "fp8": {"enabled": True, "float8_all_gather": float8_all_gather},
    }


def hf_llama():
    """A 1-layer Hugging Face Llama whose seven projections are float8-served (dimensions of 16s)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def _train(
    float8_all_gather: bool, compiled: bool = False, save: str | None = None, hf: bool = False
) -> dict:
    """STEPS steps of a tiny plait Llama at ZeRO-3 over 2 dp ranks (``compiled``: every block compiled with
    aot_eager, the same ATen kernels as eager, and recomputed in backward; asynchronous gathers prefetched):
    losses, the bytes every parameter all-gather received by dtype, and the whole weights after training
    (saved as a checkpoint to ``save`` if given). ``hf``: ``hf_llama`` instead (torchao's ``Float8Linear``)."""
    received: dict[str, int] = {}
    plain = zero_comm.all_gather_flat

    def counting(out, x, *args, **kwargs):
        key = str(out.dtype).removeprefix("torch.")
        received[key] = received.get(key, 0) + out.numel() * out.element_size()
        return plain(out, x, *args, **kwargs)

    mesh, config = ParallelMesh(), ds_config(float8_all_gather)
    if compiled:
        config = ds_config(True, overlap_comm=True, stage3_prefetch_bucket_size=10**6)
        config["compile"] = {"enabled": True, "backend": "aot_eager"}
        config["activation_checkpointing"] = {"number_checkpoints": 2}
    model = hf_llama() if hf else TransformerModel(tiny(), None, seed=3)
    engine = plait.initialize(model, config, mesh=mesh)
    batch = micro_batch(0, 0, mesh.dp_rank, vocab_size=128 if hf else 257)
    zero_comm.all_gather_flat = counting
    try:
        losses = []
        for step in range(STEPS):
            loss = engine(**batch)  # one batch: the loss falls
            loss = loss.loss if hf else loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    finally:
        zero_comm.all_gather_flat = plain
    with engine.optimizer.gathered_parameters():
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    if save:
        engine.save_checkpoint(save)
    layers = [type(m).__name__ for m in model.modules() if "Float8" in type(m).__name__]
    layers = {k: layers.count(k) for k in set(layers)}
    return {"losses": losses, "received": received, "weights": weights, "layers": layers}


def _runs(save: str) -> dict:
    return {
        "bf16": _train(False),
        "float8": _train(True, save=save),
        "compiled": _train(True, compiled=True),
        "hf-bf16": _train(False, hf=True),
        "hf-float8": _train(True, hf=True),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return str(tmp_path_factory.mktemp("float8_gather"))


@pytest.fixture(scope="module")
def runs(saved):
    return run_distributed(_runs, 2, saved)


def test_losses_and_weights_equal_the_bf16_gathers_bit_for_bit(runs):
    """Each piece is cast with the scale of the whole weight (its amax all-reduced over dp), elementwise as
    torchao casts the whole gathered weight: the same float8 values and scale, so the same matmuls, losses,
    gradients and updates, bit for bit (no tolerance); the whole weights read back are bf16. Compiled and
    recomputed blocks too (their graphs save the gathered float8 bytes for backward)."""
    for rank in runs:
        bf16 = rank["bf16"]
        assert bf16["losses"][-1] < bf16["losses"][0], bf16["losses"]
        for f8 in (rank["float8"], rank["compiled"]):
            assert f8["losses"] == bf16["losses"]
            assert bf16["weights"].keys() == f8["weights"].keys()
            for name, w in bf16["weights"].items():
                assert f8["weights"][name].dtype == torch.bfloat16, name
                assert torch.equal(f8["weights"][name], w), name


def test_a_hugging_face_llama_gathers_its_float8_linears_in_float8_with_the_same_losses(runs):
    """torchao's ``Float8Linear`` layers (the model's seven projections; the head stays bf16) compute with the
    float8-gathered weight: the bf16 gather's losses and weights bit for bit, the projections' bytes halved."""
    for rank in runs:
        bf16, f8 = rank["hf-bf16"], rank["hf-float8"]
        assert bf16["layers"] == {"Float8Linear": 7} and f8["layers"] == {"GatheredFloat8Linear": 7}
        assert f8["losses"] == bf16["losses"] and bf16["losses"][-1] < bf16["losses"][0]
        for name, w in bf16["weights"].items():
            assert torch.equal(f8["weights"][name], w), name
        projections = 2 * (
            4 * 32 * 32 + 3 * 64 * 32
        )  # q, k, v, o and gate, up, down; forward and backward
        assert f8["received"]["uint8"] == STEPS * projections
        assert (
            2 * f8["received"]["uint8"] == bf16["received"]["bfloat16"] - f8["received"]["bfloat16"]
        )


def test_the_checkpoint_of_a_float8_gather_run_holds_bf16_and_fp32_only(runs, saved):
    """float8 is a compute and a transfer format, never a storage format: bf16 weights, fp32 masters and
    moments (``test_float8_training``'s check of the bf16 gather, here with the float8 gather)."""
    from safetensors import safe_open

    dtypes = set()
    for path in glob.glob(os.path.join(saved, "**", "*.safetensors"), recursive=True):
        with safe_open(path, framework="pt") as f:
            dtypes.update(f.get_slice(k).get_dtype() for k in f.keys())
    assert dtypes == {"BF16", "F32"}


def test_the_float8_layers_gathered_bytes_are_halved(runs):
    """Counted at the collective: the bf16 run gathers only bf16; the float8 run gathers the float8 layers'
    weights as one byte an element (uint8 buffers), exactly half the bf16 bytes it no longer gathers."""
    for rank in runs:
        bf16, f8 = rank["bf16"]["received"], rank["float8"]["received"]
        assert rank["compiled"]["received"] == f8
        assert set(bf16) == {"bfloat16"} and set(f8) == {"bfloat16", "uint8"}
        assert 2 * f8["uint8"] == bf16["bfloat16"] - f8["bfloat16"]
        # every float8 weight (q, k, v, o, gate, up, down of both blocks) once for the forward and once for
        # the backward of each step, one byte an element
        c = tiny()
        kv = c.num_kv_heads * c.hidden_size // c.num_heads
        per_block = (
            2 * c.hidden_size**2 + 2 * kv * c.hidden_size + 3 * c.ffn_hidden_size * c.hidden_size
        )
        assert f8["uint8"] == STEPS * 2 * c.num_layers * per_block


BASE = {
    "train_batch_size": 2,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
}


@pytest.mark.parametrize(
    "fp8, extra, match",
    [
        (
            {"enabled": True, "recipe": "rowwise", "float8_all_gather": True},
            {"zero_optimization": {"stage": 3}},
            r"fp8.float8_all_gather .* fp8 is enabled with recipe 'rowwise': set fp8.enabled true "
            r'with fp8.recipe "tensorwise", or fp8.float8_all_gather false',
        ),
        (
            {"float8_all_gather": True},
            {"zero_optimization": {"stage": 3}},
            r"fp8.float8_all_gather .* but fp8 is not enabled",
        ),
        (
            {"enabled": True, "float8_all_gather": True},
            {"zero_optimization": {"stage": 2}},
            r"fp8.float8_all_gather casts ZeRO-3's parameter shards .* zero_optimization.stage is 2: "
            r"set zero_optimization.stage 3 or fp8.float8_all_gather false",
        ),
        (
            {"enabled": True, "float8_all_gather": True},
            {"zero_optimization": {"stage": 3}, "tensor_parallel": {"size": 2}},
            r"fp8.float8_all_gather with tensor_parallel.size 2: not built .* set "
            r"tensor_parallel.size 1 or fp8.float8_all_gather false",
        ),
    ],
)
def test_float8_all_gather_is_refused_outside_tensorwise_zero3(fp8, extra, match):
    with pytest.raises(ConfigError, match=match):
        load_config({**BASE, "fp8": fp8, **extra})


def test_a_float8_weight_tied_to_an_embedding_is_gathered_in_bf16():
    """A Hugging Face head tied to its embedding and converted (``fp8.exclude`` emptied): the embedding reads
    the gathered weight too, so it is not cast (the projections are)."""
    from plait.config.schema_fp8 import FP8Config
    from plait.precision.float8 import convert_to_float8
    from plait.precision.float8_gather import Float8Gather, GatheredFloat8Linear

    model = hf_llama()
    model.config.tie_word_embeddings = True
    model.tie_weights()
    convert_to_float8(model, FP8Config(True, exclude=[]), torch.device("cpu"))
    gather = Float8Gather(model)
    assert isinstance(model.lm_head, GatheredFloat8Linear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not gather.casts(model.lm_head.weight)
    assert gather.casts(model.model.layers[0].mlp.up_proj.weight)
