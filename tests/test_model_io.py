"""Model weights saved in one tp/pp/dp layout load exactly in any other.

GPT-2 (tied head, learned positions) and Llama (untied head, GQA) with vocabulary 1001 (padded per
tp rank) and 3 blocks. Models built with another seed are loaded and compared with the saving
layout's weights (initialization is layout-invariant, so a tp=1 build with the saving seed is the
reference): every tensor must be equal exactly (no arithmetic happens on the way).
"""

import os

import pytest
import torch
import torch.distributed as dist

from plait.checkpoint import CheckpointError, CheckpointReader, CheckpointWriter, ShardItem
from plait.checkpoint.convert import describe
from plait.checkpoint.model_io import (
    MESH_KEY,
    MODEL_CONFIG_KEY,
    config_from_meta,
    save_model_weights,
)
from plait.checkpoint.model_load import load_model_weights
from plait.layers import TransformerModel
from plait.parallel import ParallelMesh
from plait.parallel.sharding import gather_logical_state, shard_of
from plait.testing import run_distributed
from helpers import make_config

SEED, OTHER = 11, 99
ARCHES = ("gpt2", "llama")


def whole(model, group=None) -> dict:
    """Logical (unpadded) whole tensors of every parameter."""
    return {n: t.clone() for n, t in gather_logical_state(model, group).items()}


def reference(arch: str) -> dict:
    return whole(TransformerModel(make_config(arch), seed=SEED))


def stage_layers(cfg, pp: int, rank: int) -> range:
    total = cfg.num_layers + 2
    cut = [round(total * k / pp) for k in range(pp + 1)]
    return range(cut[rank], cut[rank + 1])


def assert_same(got: dict, ref: dict, what: str):
    for name, t in got.items():
        assert torch.equal(t, ref[name]), f"{what}: {name} differs"


# --------------------------------------------------------------------------------- multi-rank bodies
def _save_tp2(root: str):
    mesh = ParallelMesh(tp=2)
    for arch in ARCHES:
        model = TransformerModel(make_config(arch), mesh, seed=SEED)
        save_model_weights(model, mesh, os.path.join(root, arch), "tp2", meta={"step": 7})


def _load_tp4(root: str):
    mesh = ParallelMesh(tp=4)
    out = {}
    for arch in ARCHES:
        model = TransformerModel(make_config(arch), mesh, seed=OTHER)
        load_model_weights(model, CheckpointReader(os.path.join(root, arch), "tp2"))
        emb = model.layers["0"].word_embeddings.weight
        spec = shard_of(emb)
        start, stop = spec.logical_range()
        assert torch.all(emb[stop - start :] == 0), "vocabulary padding rows must load as zeros"
        out[arch] = whole(model, mesh.tp_group)
    return out if dist.get_rank() == 0 else None


def _save_pp_and_dp(root: str):
    """tp=2 x pp=2 (tied head copy on stage 1), then tp=2 x dp=2 (dp rank 1 writes nothing)."""
    for arch in ARCHES:
        cfg = make_config(arch)
        mesh = ParallelMesh(tp=2, pp=2)
        stage = TransformerModel(cfg, mesh, layers=stage_layers(cfg, 2, mesh.pp_rank), seed=SEED)
        save_model_weights(stage, mesh, os.path.join(root, arch), "pp2")
        mesh = ParallelMesh(tp=2, dp=2)
        model = TransformerModel(cfg, mesh, seed=SEED)
        save_model_weights(model, mesh, os.path.join(root, arch), "dp2")


# --------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def tp2_root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("model_io_tp2"))
    run_distributed(_save_tp2, 2, root)
    return root


@pytest.mark.parametrize("arch", ARCHES)
def test_tp2_checkpoint_loads_at_tp1_and_as_pp_stages(tp2_root, arch):
    ref, root = reference(arch), os.path.join(tp2_root, arch)
    reader = CheckpointReader(root, "tp2")
    cfg = make_config(arch)
    assert reader.meta["step"] == 7 and reader.meta[MESH_KEY] == {
        "tp": 2,
        "pp": 1,
        "dp": 1,
        "ep": 1,
    }
    assert config_from_meta(reader.meta) == cfg and reader.meta[MODEL_CONFIG_KEY] == cfg.to_dict()
    assert reader.shape("layers.0.word_embeddings.weight") == (1001, 64)  # padding never stored
    text = describe(root, "tp2")
    assert (
        "step 7" in text and "saved from mesh tp=2, pp=1, dp=1" in text and f"arch={arch}" in text
    )
    model = TransformerModel(cfg, seed=OTHER)
    assert load_model_weights(model, reader).missing == []
    assert_same(whole(model), ref, "tp=1")
    for rank in range(2):
        stage = TransformerModel(cfg, layers=stage_layers(cfg, 2, rank), seed=OTHER)
        assert (
            load_model_weights(stage, reader, strict=True).unexpected == []
        )  # other stage's layers are fine
        got = whole(stage)
        if arch == "gpt2" and rank == 1:  # the tied head copy loads from the embedding's name
            head = f"layers.{cfg.num_layers + 1}.weight"
            assert torch.equal(got.pop(head), ref["layers.0.word_embeddings.weight"])
        assert_same(got, ref, f"pp stage {rank}")


def test_tp2_checkpoint_loads_at_tp4(tp2_root):
    got = run_distributed(_load_tp4, 4, tp2_root)[0]
    for arch in ARCHES:
        assert_same(got[arch], reference(arch), f"{arch} tp=4")


def test_pp_and_dp_layouts_save_each_element_once(tmp_path):
    run_distributed(_save_pp_and_dp, 4, str(tmp_path))
    for arch in ARCHES:
        cfg, ref = make_config(arch), reference(arch)
        for tag in ("pp2", "dp2"):
            reader = CheckpointReader(str(tmp_path / arch), tag)
            assert set(reader.names()) == set(ref), (
                f"{arch} {tag}: names differ"
            )  # tied head not saved twice
            model = TransformerModel(cfg, seed=OTHER)
            load_model_weights(model, reader)
            assert_same(whole(model), ref, f"{arch} {tag}")
        files = CheckpointReader(str(tmp_path / arch), "dp2").index["files"]
        assert not any(f.startswith(("rank00002", "rank00003")) for f in files), (
            "dp rank 1 must not write"
        )


def _partial_checkpoint(root, model, drop, add):
    items = [ShardItem.whole(n, t) for n, t in whole(model).items() if n not in drop]
    items += [ShardItem.whole(n, torch.zeros(3)) for n in add]
    CheckpointWriter(root).save("t", items, {})
    return CheckpointReader(root, "t")


def test_strict_false_reports_missing_and_unexpected(tmp_path):
    cfg = make_config("gpt2")
    src = TransformerModel(cfg, seed=SEED)
    drop = ["layers.2.mlp.up_proj.weight", "layers.4.norm.bias"]
    add = [
        "layers.1.attn.extra",
        "layers.9.weight",
        "something_else",
        "optimizer.exp_avg.layers.1.attn_norm.weight",
        "hf_extra.pooler.dense.bias",
    ]
    reader = _partial_checkpoint(str(tmp_path), src, drop, add)
    model = TransformerModel(cfg, seed=OTHER)
    with pytest.raises(CheckpointError, match=r"missing \['layers.2.mlp.up_proj.weight'") as err:
        load_model_weights(model, reader)
    assert "layers.1.attn.extra" in str(err.value) and "strict=False" in str(err.value)
    before = whole(model)
    report = load_model_weights(model, reader, strict=False)
    assert report.missing == drop
    assert report.unexpected == ["layers.1.attn.extra", "layers.9.weight", "something_else"]
    after = whole(model)
    for name in drop:
        assert torch.equal(after[name], before[name]), f"missing {name} must keep its value"
    assert_same(
        {k: v for k, v in after.items() if k not in drop}, reference("gpt2"), "partial load"
    )
    stage = TransformerModel(
        cfg, layers=[0, 1], seed=OTHER
    )  # a stage without layer 2 misses nothing
    assert load_model_weights(stage, reader, strict=False).missing == []


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    model = TransformerModel(make_config("llama"), seed=SEED)
    save_model_weights(model, None, str(tmp_path), "v1001")
    other = TransformerModel(make_config("llama", vocab_size=1000), seed=OTHER)
    before = whole(other)
    with pytest.raises(CheckpointError) as err:
        load_model_weights(other, str(tmp_path))
    msg = str(err.value)
    assert "layers.0.word_embeddings.weight" in msg and "[1001, 64]" in msg and "[1000, 64]" in msg
    assert_same(whole(other), before, "a failed load changes nothing")


def test_meta_device_model_is_materialized_from_the_checkpoint(tmp_path):
    save_model_weights(TransformerModel(make_config("gpt2"), seed=SEED), None, str(tmp_path), "a")
    model = TransformerModel(make_config("gpt2"), device="meta")
    load_model_weights(model, str(tmp_path))
    emb = model.layers["0"].word_embeddings.weight
    assert not any(p.is_meta for p in model.parameters())
    assert model.head.weight is emb, "the tied head must still share the embedding"
    assert shard_of(emb).logical_shape == (1001, 64)
    assert_same(whole(model), reference("gpt2"), "meta")
    ids = torch.randint(0, 1001, (2, 8))
    assert torch.equal(
        model(input_ids=ids), TransformerModel(make_config("gpt2"), seed=SEED)(input_ids=ids)
    )
