"""Hugging Face <-> plait conversion of mixture-of-experts models (Mixtral, Qwen3-MoE) against transformers.

Each model is built by transformers from a small config with seeded random weights (norm weights perturbed
away from 1 so that a mapping error shows), float32, no download, and saved with ``save_pretrained``, which
in transformers 5.24 writes the experts one ``Linear`` per expert (the hub layout). plait imports it
(``from_hf``), runs it at tp=1, tp=2 and ep=2 (gloo), exports it (``to_hf``) and transformers loads the export.

Tolerance: logits to ``RTOL = 1e-5`` in the norm-relative error ``||plait - hf||_2 / ||hf||_2`` (float64 over
all logits, ``helpers.rel_err``). plait and transformers compute the same float32 operations in other
orders (fused vs. per-expert GEMMs, other matmul blockings, the tp split of heads and vocabulary), so each
of the ~10 sequential stages of these 2-layer models (norm, q/k/v, attention, o, router, experts, head)
adds a rounding error of about sqrt(n) u relative, n <= 128 its inner dimension and u = 2^-24 the float32
unit roundoff: sqrt(128) x 6e-8 = 7e-7 per stage, about 7e-6 over the model. Measured: about 2e-7. A
routing decision that flips on a near tie would show as an error far above the bound, not hide in it.
The exported weights are copies, so they must be bit-identical and transformers' logits from them equal.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

from plait.checkpoint import CheckpointReader
from plait.checkpoint.convert import from_hf, to_hf
from plait.checkpoint.hf import config_from_hf, config_to_hf
from plait.checkpoint.model_io import config_from_meta, save_model_weights
from plait.checkpoint.model_load import load_model_weights
from plait.layers import TransformerModel
from plait.models import preset
from plait.parallel import ParallelMesh
from plait.testing import run_distributed
from helpers import rel_err
from test_convert_hf import _tp_body, assert_bit_identical, hf_model, plait_forward, st_tensors

RTOL = 1e-5
VOCAB = 1001  # odd: padded at tp=2


def _save_random(model, path):
    """Perturb the norm weights (ones at init) and save ``model`` with ``save_pretrained``."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("mixtral_hf")
    _save_random(transformers.MixtralForCausalLM(cfg), out)
    return out


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """Qwen3-MoE with head_dim 24 != hidden/heads = 16 and norm_topk_prob False (plain top-k probabilities)."""
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        rope_theta=1e6,
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("qwen3_moe_hf")
    _save_random(transformers.Qwen3MoeForCausalLM(cfg), out)
    return out


def _batch(seed):
    return {
        "input_ids": torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    }


def _hf_logits(cls_name, path, batch):
    with torch.no_grad():
        return hf_model(cls_name, path)(**batch).logits


def _ep_body(root, batch, save_root):
    """On both ranks: load with the experts split over ep=2 (each rank 2 of the 4 or 4 of the 8; both run the
    same batch, their tokens crossing by all-to-all), run, save in this layout; rank 0 returns the logits."""
    import torch.distributed as dist

    mesh = ParallelMesh(ep=2)
    out, model = plait_forward(root, batch, mesh=mesh)
    assert model.get_parameter("layers.1.mlp.gate_proj").shape[0] == model.config.num_experts // 2
    save_model_weights(model, mesh, save_root, "ep2")
    return out if dist.get_rank() == 0 else None


def _import_tp2_export(hf_dir, cls_name, tmp_path):
    """from_hf, logits at tp=1, tp=2 and ep=2 against transformers; to_hf of the tp=2 and ep=2 checkpoints
    round-trips."""
    report = from_hf(str(hf_dir), str(tmp_path / "plait"))
    assert report.architecture == cls_name and report.missing == [] and report.extra == []
    batch = _batch(2)
    batch["input_ids"][0, 0] = VOCAB - 1  # the last real row, next to the padding
    ref = _hf_logits(cls_name, hf_dir, batch)
    err1 = rel_err(plait_forward(tmp_path / "plait", batch)[0], ref)
    logits = run_distributed(
        _tp_body, 2, str(tmp_path / "plait"), 2, batch, str(tmp_path / "tp2"), None
    )[0]
    err2 = rel_err(logits, ref)
    by_ep = run_distributed(_ep_body, 2, str(tmp_path / "plait"), batch, str(tmp_path / "ep2"))[0]
    err3 = rel_err(by_ep, ref)
    print(f"{cls_name} logits rel err tp=1 {err1:.2e}, tp=2 {err2:.2e}, ep=2 {err3:.2e}")
    assert logits.shape == by_ep.shape == ref.shape and max(err1, err2, err3) <= RTOL
    out = to_hf(str(tmp_path / "ep2"), str(tmp_path / "hf_ep2"))
    assert out.architecture == cls_name and out.missing == [] and out.dropped == []
    assert_bit_identical(tmp_path / "hf_ep2", st_tensors(hf_dir))
    out = to_hf(str(tmp_path / "tp2"), str(tmp_path / "hf"))
    assert out.architecture == cls_name and out.missing == [] and out.dropped == []
    assert_bit_identical(tmp_path / "hf", st_tensors(hf_dir))
    model, info = getattr(transformers, cls_name).from_pretrained(
        str(tmp_path / "hf"), dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # no missing, unexpected or mismatched weights
    with torch.no_grad():
        assert torch.equal(model.eval()(**batch).logits, ref)
    return report


def test_mixtral_tp2_logits_match_and_round_trip_is_bit_identical(mixtral_dir, tmp_path):
    names = set(st_tensors(mixtral_dir))
    assert (
        "model.layers.0.block_sparse_moe.experts.3.w2.weight" in names
    )  # what transformers 5.24 saves
    report = _import_tp2_export(mixtral_dir, "MixtralForCausalLM", tmp_path)
    c = report.config
    assert (c.arch, c.num_experts, c.moe_top_k, c.moe_ffn_hidden_size, c.moe_normalize_topk) == (
        "mixtral",
        4,
        2,
        96,
        True,
    )
    assert c.rope_theta == 1e6 and c.moe_balance_loss_coef == pytest.approx(0.001) and not c.qk_norm


def test_qwen3_moe_tp2_logits_match_and_round_trip_is_bit_identical(qwen_dir, tmp_path):
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in set(st_tensors(qwen_dir))
    report = _import_tp2_export(qwen_dir, "Qwen3MoeForCausalLM", tmp_path)
    c = report.config
    assert (c.arch, c.head_dim, c.qk_norm, c.num_experts, c.moe_ffn_hidden_size) == (
        "qwen3_moe",
        24,
        True,
        8,
        48,
    )
    assert c.ffn_hidden_size == 128 and not c.moe_normalize_topk


# (hub prefix of a block's MoE, its per-expert (gate, up, down) names) per family
HUB_EXPERTS = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def _fused_layout(tensors: dict, family: str) -> dict:
    """The hub's per-expert tensors in transformers 5's in-memory layout, built here: per block
    ``mlp.experts.gate_up_proj`` ``[E, 2 ffn, h]`` (each expert's gate rows, then its up rows),
    ``mlp.experts.down_proj`` ``[E, h, ffn]`` and the router ``mlp.gate.weight``."""
    moe, (gate, up, down) = HUB_EXPERTS[family]
    out, experts = {}, {}
    for name, t in tensors.items():
        parts = name.split(".") + [""] * 5
        if (
            parts[3] == moe and parts[4] == "experts"
        ):  # model.layers.{i}.{moe}.experts.{j}.{proj}.weight
            experts.setdefault(int(parts[2]), {}).setdefault(parts[6], {})[int(parts[5])] = t
        elif parts[3] == moe and parts[4] == "gate":
            out[f"model.layers.{parts[2]}.mlp.gate.weight"] = t
        else:
            out[name] = t
    for i, projs in experts.items():
        js = sorted(projs[gate])
        out[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([projs[gate][j], projs[up][j]]) for j in js]
        )
        out[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([projs[down][j] for j in js])
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_fused_in_memory_layout_imports_like_the_hub_layout(
    family, mixtral_dir, qwen_dir, tmp_path
):
    """transformers 5's in-memory names (``mlp.experts.gate_up_proj`` [E, 2 ffn, h], ``mlp.gate``) give the
    same plait tensors as the per-expert hub names ``save_pretrained`` writes. The fused file is built from the
    hub file here (transformers 4 keeps the hub layout in memory too); under transformers 5 it must equal the
    model's own ``state_dict()``."""
    hf_dir, cls_name = (
        (mixtral_dir, "MixtralForCausalLM")
        if family == "mixtral"
        else (qwen_dir, "Qwen3MoeForCausalLM")
    )
    fused = _fused_layout(st_tensors(hf_dir), family)
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    if int(transformers.__version__.split(".")[0]) >= 5:
        state = hf_model(cls_name, hf_dir).state_dict()
        assert set(fused) == set(state) and all(torch.equal(fused[k], state[k]) for k in fused)
    (tmp_path / "fused").mkdir()
    save_file(
        {k: v.contiguous() for k, v in fused.items()},
        str(tmp_path / "fused" / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (tmp_path / "fused" / "config.json").write_text((hf_dir / "config.json").read_text())
    from_hf(str(hf_dir), str(tmp_path / "hub"))
    b = from_hf(str(tmp_path / "fused"), str(tmp_path / "mem"))
    assert b.missing == [] and b.extra == [] and b.architecture == cls_name
    ra, rb = CheckpointReader(str(tmp_path / "hub")), CheckpointReader(str(tmp_path / "mem"))
    assert ra.names() == rb.names()
    for name in ra.names():
        assert torch.equal(ra.read(name), rb.read(name)), name


def test_qk_norm_fused_projections_and_tp2_gradients(qwen_dir, tmp_path):
    """qk_norm with fused q/k/v gives the unfused logits; at tp=2 the q/k norm weights' gradients (each rank
    holds some heads) sum over tp to the single-process gradients."""
    from_hf(str(qwen_dir), str(tmp_path / "plait"))
    batch = _batch(5)
    ref, model = plait_forward(tmp_path / "plait", batch)
    assert model.layers["1"].attn.q_norm.weight.shape == (24,)
    cfg = config_from_meta(CheckpointReader(str(tmp_path / "plait")).meta).replace(
        fused_projections=True
    )
    fused = TransformerModel(cfg, device="meta").eval()
    load_model_weights(fused, str(tmp_path / "plait"))
    with torch.no_grad():
        assert rel_err(fused.head.gather_logits(fused(**batch)), ref) <= RTOL
    grads1 = _norm_grads(str(tmp_path / "plait"), batch, None)
    grads2 = run_distributed(_norm_grads, 2, str(tmp_path / "plait"), batch, 2)[0]
    assert set(grads1) == set(grads2) and len(grads1) == 4
    for name, g in grads1.items():
        assert rel_err(grads2[name], g) <= RTOL, name


def _norm_grads(root, batch, tp):
    """Gradients of every q/k norm weight after ``loss.backward()`` (at ``tp`` when given; rank 0 returns)."""
    mesh = ParallelMesh(tp=tp) if tp else None
    model = TransformerModel(config_from_meta(CheckpointReader(root).meta), mesh, device="meta")
    load_model_weights(model, root)
    model(input_ids=batch["input_ids"], labels=batch["input_ids"]).backward()
    grads = {
        n: p.grad.clone() for n, p in model.named_parameters() if "_norm" in n and ".attn." in n
    }
    return grads if tp is None or torch.distributed.get_rank() == 0 else None


# ------------------------------------------------------------------------------------- presets and errors
def test_presets_sizes_and_active_parameters():
    """Total and active parameters (all minus the E - k unused experts' 3 h ffn weights per layer)."""

    def active(c):
        return (
            c.num_parameters()
            - c.num_layers
            * (c.num_experts - c.moe_top_k)
            * 3
            * c.hidden_size
            * c.moe_ffn_hidden_size
        )

    big = preset("mixtral-8x7b")
    assert (big.num_parameters(), active(big)) == (
        46_702_792_704,
        12_879_925_248,
    )  # the paper's 47B / 13B
    small = preset("mixtral-1b-active")
    assert (small.num_parameters(), active(small)) == (3_151_300_608, 1_037_371_392)
    qwen = preset("qwen3-30b-a3b")
    assert qwen.head_dim == 128 and qwen.qk_norm
    assert (qwen.num_parameters(), active(qwen)) == (
        30_532_122_624,
        3_353_032_704,
    )  # the model card: 30.5B / 3.3B
    for name in (
        "mixtral-8x7b",
        "mixtral-1b-active",
        "mixtral-tiny",
        "qwen3-30b-a3b",
        "qwen3-moe-tiny",
    ):
        c = preset(name)
        assert config_from_hf(config_to_hf(c).to_dict()) == c, name  # through HF's config and back


def _mixtral(**kw):
    return {
        "model_type": "mixtral",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 1,
        "intermediate_size": 96,
        "vocab_size": 100,
        "num_local_experts": 4,
        **kw,
    }


def _qwen(**kw):
    return {
        "model_type": "qwen3_moe",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "vocab_size": 100,
        "num_experts": 4,
        **kw,
    }


@pytest.mark.parametrize(
    "raw, match",
    [
        (_mixtral(sliding_window=4096), "sliding_window 4096"),
        (_mixtral(router_jitter_noise=0.1), "router_jitter_noise 0.1"),
        (_mixtral(hidden_act="gelu"), "hidden_act 'gelu'"),
        (
            _mixtral(rope_scaling={"rope_type": "linear", "factor": 2.0}),
            "mixtral config: rope scaling",
        ),
        (_qwen(decoder_sparse_step=2), "decoder_sparse_step 2"),
        (_qwen(mlp_only_layers=[1]), r"mlp_only_layers \[1\]"),
        (_qwen(attention_bias=True), "attention_bias True"),
        (_qwen(use_sliding_window=True, sliding_window=4096), "sliding_window 4096"),
    ],
)
def test_unsupported_hf_configs_are_named(raw, match):
    with pytest.raises(ValueError, match=match):
        config_from_hf(json.loads(json.dumps(raw)))


@pytest.mark.parametrize(
    "name, change, match",
    [
        ("mixtral-tiny", dict(moe_normalize_topk=False), "moe_normalize_topk"),
        ("mixtral-tiny", dict(qk_norm=True), "qk_norm"),
        ("mixtral-tiny", dict(moe_shared_ffn_hidden_size=64), "moe_shared_ffn_hidden_size"),
        ("qwen3-moe-tiny", dict(qk_norm=False), "qk_norm"),
        ("qwen3-moe-tiny", dict(moe_router_order="topk_softmax"), "moe_router_order"),
        ("qwen3-moe-tiny", dict(moe_capacity_factor=1.25), "moe_capacity_factor"),
        ("qwen3-moe-tiny", dict(moe_bias_update_rate=1e-3), "moe_bias_update_rate"),
        ("qwen3-moe-tiny", dict(num_experts=0), "num_experts=0"),
    ],
)
def test_inexpressible_plait_configs_are_named(name, change, match):
    with pytest.raises(ValueError, match=match):
        config_to_hf(preset(name, **change))


def test_save_reload_keeps_head_dim_and_qk_norm(tmp_path):
    """A plait checkpoint of a qk_norm model with head_dim != hidden/heads reloads into the same config."""
    cfg = preset("qwen3-moe-tiny", num_layers=1)
    model = TransformerModel(cfg)
    save_model_weights(model, None, str(tmp_path), "t")
    again = config_from_meta(CheckpointReader(str(tmp_path), "t").meta)
    assert again == cfg and again.head_dim == 48
