"""A checkpoint that cannot be trusted is refused, naming why: damaged ``latest`` or JSON (the file), an index
whose own checksum does not match, a model that computes differently (the field, both values)."""

import pytest
import torch

import plait
from plait.checkpoint.errors import CheckpointError
from plait.layers import TransformerModel
from plait.models import preset
from plait.parallel import ParallelMesh
from helpers import tiny
from faults_helpers import ds_config


@pytest.mark.parametrize("damage", ["latest", "meta"])
def test_damaged_json_and_latest_raise_a_checkpoint_error_naming_the_file(tmp_path, damage):
    from plait.checkpoint.errors import read_json, read_text

    engine = plait.initialize(
        TransformerModel(tiny(), ParallelMesh(), seed=5), ds_config(2), mesh=ParallelMesh()
    )
    engine.save_checkpoint(tmp_path)
    path = tmp_path / "latest" if damage == "latest" else tmp_path / "global_step0" / "meta.json"
    path.write_bytes(b"\xff\xfe not text")
    read = read_text if damage == "latest" else read_json
    with pytest.raises(CheckpointError, match=f"{path} is damaged: not UTF-8"):
        read(str(path))
    with pytest.raises(CheckpointError, match="damaged|checksum|does not match"):
        engine.load_checkpoint(tmp_path)


@pytest.mark.parametrize(
    "change", [{"num_heads": 8, "num_kv_heads": 4}, {"rope_theta": 5e5}, {"norm_eps": 1e-1}]
)
def test_a_checkpoint_refuses_a_model_that_computes_differently(tmp_path, change):
    mesh = ParallelMesh()
    saved = plait.initialize(TransformerModel(tiny(), mesh, seed=5), ds_config(2), mesh=mesh)
    saved.save_checkpoint(tmp_path)
    other = plait.initialize(
        TransformerModel(tiny().replace(**change), mesh, seed=5), ds_config(2), mesh=mesh
    )
    key, value = next(iter(change.items()))
    with pytest.raises(
        CheckpointError, match=f"{key}: checkpoint {getattr(tiny(), key)!r}, model {value!r}"
    ):
        other.load_checkpoint(tmp_path)
    other.load_checkpoint(tmp_path, allow_config_change=True)  # on purpose: loads, same weights
    with saved.optimizer.gathered_parameters(), other.optimizer.gathered_parameters():
        for (n, a), (_, b) in zip(saved.module.named_parameters(), other.module.named_parameters()):
            assert torch.equal(a, b), n


def test_the_index_carries_its_own_checksum(tmp_path):
    engine = plait.initialize(
        TransformerModel(tiny(), ParallelMesh(), seed=5), ds_config(2), mesh=ParallelMesh()
    )
    engine.save_checkpoint(tmp_path)
    index = tmp_path / "global_step0" / "index.json"
    text = index.read_text()
    assert '"index_checksum": "sha256:' in text
    index.write_text(
        text.replace('"writers": 1', '"writers": 2')
    )  # a valid edit the old checks pass
    with pytest.raises(CheckpointError, match="its own checksum .* does not match its contents"):
        engine.load_checkpoint(tmp_path)


def test_a_gpt2_checkpoint_refuses_another_activation(tmp_path):
    gpt2 = preset("gpt2-tiny", vocab_size=257, hidden_size=32, num_layers=2, num_heads=4)
    mesh = ParallelMesh()
    cfg = {**ds_config(2), "gradient_clipping": 0.0}
    plait.initialize(TransformerModel(gpt2, mesh, seed=5), cfg, mesh=mesh).save_checkpoint(tmp_path)
    other = plait.initialize(
        TransformerModel(gpt2.replace(activation="gelu"), mesh, seed=5), cfg, mesh=mesh
    )
    with pytest.raises(CheckpointError, match="activation: checkpoint 'gelu_tanh', model 'gelu'"):
        other.load_checkpoint(tmp_path)
