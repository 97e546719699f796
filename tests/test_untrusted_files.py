"""Loading what someone else wrote (issue 41, items 7-9): a checkpoint, a Hugging Face folder or a tokenizer
from elsewhere never makes plait open a file outside its folder, block on a FIFO, read an endless device or a
huge file, or allocate from absurd config sizes. Each loader is tried: ``plait convert from-hf`` (``from_hf``),
``plait.hf.from_pretrained``, ``SafetensorsWeights`` (what ``plait.initialize(weights=...)`` and the Trainer
read), the plait ``CheckpointReader`` (``latest``, ``index.json``, ``meta.json``, its shards), ``to_hf``'s
tokenizer copy, and a plait model built from a preset with overrides.

A loader that would hang or read without end on the code before the fix runs in a thread under an address-space
allowance of 1 GiB (``refused_quickly``): the test then fails within about a second instead of hanging or
exhausting the machine's memory.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import threading

import pytest
import torch
import transformers

from plait.checkpoint import CheckpointError, CheckpointReader, ShardItem, save
from plait.checkpoint.convert import HF_INDEX, from_hf, to_hf
from plait.cli import main
from plait.layers import TransformerModel
from plait.models import preset
from plait.untrusted import SMALL_FILE_CAP
from plait.zero.weights import SafetensorsWeights

SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def hf_source(tmp_path_factory):
    """A tiny Llama saved as two safetensors shards with model.safetensors.index.json, and its plait import."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )
    path = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(path, max_shard_size="12KB")
    assert sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) == [
        SHARD,
        SHARD.replace("1-of", "2-of"),
    ]
    plait_root = str(path.parent / "plait")
    from_hf(str(path), plait_root)
    return path, plait_root


@pytest.fixture
def hf_dir(hf_source, tmp_path):
    """A fresh copy of the Hugging Face folder, at ``tmp_path/model`` (``tmp_path`` is outside it)."""
    return shutil.copytree(hf_source[0], tmp_path / "model")


@pytest.fixture
def plait_root(tmp_path):
    """A small plait checkpoint ``root/t`` with a meta.json, and the path of its tag folder."""
    root = tmp_path / "root"
    save(str(root), "t", [ShardItem.whole("a", torch.arange(12.0).reshape(3, 4))], {"step": 3})
    return root, root / "t"


def _address_space_limit(extra: int) -> tuple[int, int]:
    """Lower the soft RLIMIT_AS to this process's current size plus ``extra`` bytes; returns the old limits."""
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    old = resource.getrlimit(resource.RLIMIT_AS)
    hard = old[1] if old[1] != resource.RLIM_INFINITY else size + extra
    resource.setrlimit(resource.RLIMIT_AS, (min(size + extra, hard), old[1]))
    return old


def refused_quickly(call, seconds: float = 1.0, fifo=None) -> BaseException:
    """The exception ``call()`` raises within ``seconds`` (in a thread, allowed 1 GiB more address space).
    Fails the test if it returns, or is still running then (a FIFO ``fifo`` is opened for writing to free a
    reader blocked on it)."""
    out: list = []

    def run():
        try:
            call()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - the test inspects whatever it raised
            out.append(e)

    old = _address_space_limit(1 << 30)
    thread = threading.Thread(target=run, daemon=True)
    try:
        thread.start()
        thread.join(seconds)
        hung = thread.is_alive()
        if hung and fifo is not None:
            os.close(
                os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            )  # the blocked reader gets end-of-file
        thread.join(30)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, old)
    assert not hung, (
        f"still running after {seconds} s: it blocks on or reads without end from the file"
    )
    assert out[0] is not None, "the loader accepted the file"
    assert isinstance(out[0], (CheckpointError, ValueError)), f"not refused by name: {out[0]!r}"
    return out[0]


def _from_pretrained(folder):
    from plait.hf import from_pretrained

    return from_pretrained(transformers.LlamaForCausalLM, folder)


def _cli_from_hf(folder, capsys):
    status = main(["convert", "from-hf", str(folder), str(folder.parent / "out")])
    err = capsys.readouterr().err
    if status == 0:
        return None
    assert status == 2 and err.startswith("plait convert from-hf: ")
    return err


HF_LOADERS = {
    "from-hf": lambda folder: from_hf(str(folder), str(folder.parent / "out")),
    "from_pretrained": _from_pretrained,
    "SafetensorsWeights": SafetensorsWeights,
}


def _retarget(hf_dir, name: str) -> None:
    """Point the index's entries of the first shard at ``name`` (a copy of that shard sits outside the folder)."""
    shutil.copyfile(hf_dir / SHARD, hf_dir.parent / "outside.safetensors")
    index = json.loads((hf_dir / HF_INDEX).read_text())
    index["weight_map"] = {k: name if v == SHARD else v for k, v in index["weight_map"].items()}
    (hf_dir / HF_INDEX).write_text(json.dumps(index))


# ---------------------------------------------------------------------------------- 7: inside the folder
@pytest.mark.parametrize("form", ["dot-dot", "absolute", "symlink"])
@pytest.mark.parametrize("loader", sorted(HF_LOADERS))
def test_a_weight_map_naming_a_file_outside_the_folder_is_refused(hf_dir, loader, form):
    outside = hf_dir.parent / "outside.safetensors"
    name = {
        "dot-dot": "../outside.safetensors",
        "absolute": str(outside),
        "symlink": "link.safetensors",
    }[form]
    _retarget(hf_dir, name)
    if form == "symlink":
        os.symlink(outside, hf_dir / "link.safetensors")
    with pytest.raises((CheckpointError, ValueError)) as err:
        HF_LOADERS[loader](hf_dir)
    text = str(err.value)
    if form == "symlink":
        assert (
            f"{hf_dir / 'link.safetensors'} resolves to {outside}, outside {hf_dir}; refusing"
            in text
        )
    else:
        assert (
            f"{HF_INDEX} weight_map entry {name!r} is not a plain relative name inside {hf_dir}"
            in text
        )


def test_the_cli_refuses_a_weight_map_outside_the_folder_and_writes_nothing(hf_dir, capsys):
    _retarget(hf_dir, "../outside.safetensors")
    err = _cli_from_hf(hf_dir, capsys)
    assert err is not None and "'../outside.safetensors' is not a plain relative name" in err
    assert not (hf_dir.parent / "out").exists()


@pytest.mark.parametrize("name", ["rank00000.safetensors", "index.json", "meta.json", "latest"])
def test_a_plait_checkpoint_file_linked_outside_its_folder_is_refused(plait_root, tmp_path, name):
    root, tag_dir = plait_root
    folder = root if name == "latest" else tag_dir
    outside = tmp_path / f"copy-of-{name}"
    shutil.copyfile(folder / name, outside)  # the same bytes: only where it lies is wrong
    os.remove(folder / name)
    os.symlink(outside, folder / name)
    with pytest.raises(
        CheckpointError, match=f"{folder / name} resolves to {outside}, outside {folder}; refusing"
    ):
        CheckpointReader(str(root))


def test_tokenizer_files_are_copied_only_from_inside_their_folder(hf_source, tmp_path):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    (tokenizer / "vocab.json").write_text('{"a": 0}')
    (tmp_path / "id_rsa").write_text("PRIVATE KEY")
    os.symlink(tmp_path / "id_rsa", tokenizer / "tokenizer.json")
    with pytest.raises(
        CheckpointError, match=f"{tokenizer / 'tokenizer.json'} resolves to {tmp_path / 'id_rsa'}"
    ):
        to_hf(hf_source[1], str(tmp_path / "out"), tokenizer_from=str(tokenizer))
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    os.remove(tokenizer / "tokenizer.json")
    report = to_hf(
        hf_source[1], str(tmp_path / "out"), tokenizer_from=str(tokenizer), overwrite=True
    )
    assert (
        "vocab.json" in report.files and (tmp_path / "out" / "vocab.json").read_text() == '{"a": 0}'
    )


def test_a_hub_snapshot_whose_files_link_into_its_blobs_loads(hf_source, tmp_path):
    """The hub cache keeps files in ``<repo>/blobs`` and links them from ``<repo>/snapshots/<rev>``: inside."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(os.listdir(hf_source[0]))):
        shutil.copyfile(hf_source[0] / f, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / f)
    assert from_hf(str(snapshot), str(tmp_path / "plait")).tensors == 12
    assert (
        len(SafetensorsWeights(snapshot).files) == 12
        and _from_pretrained(snapshot).config.vocab_size == 64
    )


# ---------------------------------------------------------------------------------- 8: regular, bounded files
def _plait_loader(root):
    return lambda: CheckpointReader(str(root))


FILES = [
    ("plait", "latest"),
    ("plait", "index.json"),
    ("plait", "meta.json"),
    ("from-hf", "config.json"),
    ("from-hf", HF_INDEX),
    ("from_pretrained", "config.json"),
    ("SafetensorsWeights", HF_INDEX),
]


def _place(plait_root, hf_dir, loader, name):
    """(the path of ``name`` for ``loader``, the call that loads it)."""
    if loader == "plait":
        root, tag_dir = plait_root
        return (root if name == "latest" else tag_dir) / name, _plait_loader(root)
    return hf_dir / name, lambda: HF_LOADERS[loader](hf_dir)


@pytest.mark.parametrize("loader, name", FILES)
def test_a_fifo_is_refused_within_a_second(plait_root, hf_dir, loader, name):
    path, call = _place(plait_root, hf_dir, loader, name)
    os.remove(path)
    os.mkfifo(path)
    err = refused_quickly(call, fifo=path)
    assert f"{path} is a FIFO (named pipe), not a regular file; refusing to read it" in str(err)


@pytest.mark.parametrize(
    "loader, name, device",
    [
        ("plait", "latest", "/dev/urandom"),
        ("plait", "index.json", "/dev/zero"),
        ("from-hf", "config.json", "/dev/zero"),
        ("from_pretrained", HF_INDEX, "/dev/zero"),
        ("from_pretrained", "config.json", "/dev/urandom"),
    ],
)
def test_a_link_to_an_endless_device_is_refused(plait_root, hf_dir, loader, name, device):
    path, call = _place(plait_root, hf_dir, loader, name)
    os.remove(path)
    os.symlink(device, path)
    err = refused_quickly(call)
    assert f"{path} resolves to {device}, outside" in str(err)


@pytest.mark.parametrize(
    "loader, name",
    [
        ("plait", "index.json"),
        ("plait", "latest"),
        ("from-hf", "config.json"),
        ("from-hf", HF_INDEX),
        ("from_pretrained", "config.json"),
    ],
)
def test_a_file_over_the_size_cap_is_refused_before_it_is_read(plait_root, hf_dir, loader, name):
    path, call = _place(plait_root, hf_dir, loader, name)
    with open(path, "r+b") as f:
        f.truncate(SMALL_FILE_CAP + 1)  # sparse: nothing is written
    err = refused_quickly(call)
    assert f"{path} has {SMALL_FILE_CAP + 1} bytes, more than the {SMALL_FILE_CAP} (64 MiB)" in str(
        err
    )


# ---------------------------------------------------------------------------------- 9: absurd sizes
ABSURD = [
    (
        "hidden_size",
        10**9,
        "hidden_size=1000000000, num_hidden_layers=1, vocab_size=64: the model would need "
        "at least 2.00e+18 parameters (8.00e+18 bytes of float32 weights), but its safetensors files hold",
    ),
    (
        "num_hidden_layers",
        10**6,
        "hidden_size=16, num_hidden_layers=1000000, vocab_size=64: the model would "
        "need at least 5.12e+08 parameters (2.05e+09 bytes of float32 weights)",
    ),
    ("vocab_size", -5, "vocab_size=-5: must be a whole number >= 1"),
    ("num_attention_heads", 2.5, "num_attention_heads=2.5: must be a whole number >= 1"),
    ("intermediate_size", 0, "intermediate_size=0: must be a whole number >= 1"),
]


@pytest.mark.parametrize("key, value, message", ABSURD, ids=[a[0] for a in ABSURD])
@pytest.mark.parametrize("loader", ["cli", "from_pretrained"])
def test_absurd_config_sizes_are_refused_by_key(hf_dir, capsys, loader, key, value, message):
    config = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**config, key: value}))
    if loader == "cli":
        assert message in (_cli_from_hf(hf_dir, capsys) or "accepted")
        assert not (hf_dir.parent / "out").exists()
    else:
        with pytest.raises(ValueError) as err:
            _from_pretrained(hf_dir)
        assert f"{hf_dir / 'config.json'} {message}" in str(err.value)


@pytest.mark.parametrize(
    "override, message",
    [
        ({"vocab_size": -5}, "TransformerConfig vocab_size must be an int >= 1, got -5"),
        ({"num_heads": 0}, "TransformerConfig num_heads must be an int >= 1, got 0"),
        ({"hidden_size": 64.5}, "TransformerConfig hidden_size must be an int >= 1, got 64.5"),
        ({"num_layers": True}, "TransformerConfig num_layers must be an int >= 1, got True"),
    ],
)
def test_preset_overrides_that_are_not_sizes_are_refused_by_field(override, message):
    with pytest.raises(ValueError) as err:
        preset("llama-tiny", **override)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "override, bytes_needed",
    [
        ({"hidden_size": 10**9}, "need 4.80e+19 bytes (1.20e+19 elements"),
        ({"num_layers": 10**6}, "need 7.38e+11 bytes (1.85e+11 elements"),
        ({"vocab_size": 10**12}, "need 1.02e+15 bytes (2.56e+14 elements"),
    ],
)
def test_a_model_too_large_for_the_host_is_refused_before_allocation_but_builds_on_meta(
    override, bytes_needed
):
    """llama-tiny keeps its explicit MLP width, so only the overridden size grows."""
    config = preset("llama-tiny", **override)
    err = refused_quickly(lambda: TransformerModel(config))
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert str(err).startswith("TransformerModel on cpu: the parameters of layers 0..")
    assert bytes_needed in str(err) and f"more than the {host:.2e} bytes of memory cpu has" in str(
        err
    )
    if "num_layers" not in override:  # a meta build allocates nothing: any size
        assert sum(p.numel() for p in TransformerModel(config, device="meta").parameters()) > 8e12


def test_the_parameter_count_needs_one_block_and_matches_every_block_counted():
    from plait.layers.model import logical_shapes

    for name in ("llama-tiny", "gpt2-tiny", "bert-tiny", "mixtral-tiny", "qwen3-moe-tiny"):
        config = preset(name, num_layers=3)
        assert config.num_parameters() == sum(
            torch.Size(s).numel() for s in logical_shapes(config).values()
        )
    assert (
        preset("llama-tiny", num_layers=10**6).num_parameters() == 184_578_097_280
    )  # no 10**6 blocks built
