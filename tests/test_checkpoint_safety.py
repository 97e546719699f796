"""plait.checkpoint storage layer in one process: metadata, validation (corruption, another model's index, what
a read touches), keep_last, asynchronous saves, crash safety. Multi-rank saves, resharding reads and the box
arithmetic are tests/test_checkpoint_format.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from plait.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    ShardItem,
    list_tags,
    model_fingerprint,
    optimizer_key,
    read_latest,
    save,
    tensor_from_json,
    tensor_to_json,
)
from checkpoint_helpers import full

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _simple_items():
    a, b = full("a", (6, 4)), full("b", (5,), torch.bfloat16)
    return [
        ShardItem("a", a[:2], (6, 4), (0, 0)),
        ShardItem("a", a[2:], (6, 4), (2, 0)),
        ShardItem.whole("b", b),
        ShardItem.whole("s", torch.tensor(3.0)),
    ]


def test_meta_round_trip_and_non_json_rejected_with_key_path(tmp_path):
    root = str(tmp_path)
    meta = {
        "step": 10,
        "lr": 1e-3,
        "mesh": {"tp": 2, "dp": 2},
        "nan": float("nan"),
        "rng": tensor_to_json(torch.get_rng_state()),
        "client_state": {"hist": [1, 2.5, None, "x"]},
    }
    save(root, "s", _simple_items(), meta)
    got = CheckpointReader(root).meta
    assert got["mesh"] == meta["mesh"] and got["client_state"] == meta["client_state"]
    assert torch.equal(tensor_from_json(got["rng"]), torch.get_rng_state())
    bad = {"step": 11, "client_state": {"sampler": [0, {"pos": object()}]}}
    with pytest.raises(
        CheckpointError, match=r"meta\['client_state'\]\['sampler'\]\[1\]\['pos'\]: builtins.object"
    ):
        save(root, "s2", _simple_items(), bad)
    with pytest.raises(CheckpointError, match=r"tag"):
        save(root, "../x", _simple_items(), {})
    assert read_latest(root) == "s" and sorted(os.listdir(root)) == ["latest", "s"]


def _corrupt_root(tmp_path):
    root = str(tmp_path / "ck")
    a = full("a", (8, 4))
    save(
        root,
        "t",
        [
            ShardItem("a", a[:4], (8, 4), (0, 0)),
            ShardItem("a", a[4:], (8, 4), (4, 0)),
            ShardItem.whole("b", full("b", (300,))),
        ],
        {},
        max_file_bytes=200,
    )
    files = sorted(f for f in os.listdir(os.path.join(root, "t")) if f.endswith(".safetensors"))
    assert files == [
        "rank00000-000.safetensors",
        "rank00000-001.safetensors",
    ]  # max_file_bytes split
    return root, os.path.join(root, "t"), files


def test_corruption_is_detected_naming_the_file(tmp_path):
    root, path, files = _corrupt_root(tmp_path)
    assert torch.equal(CheckpointReader(root).read("a"), full("a", (8, 4)))
    victim = os.path.join(path, files[1])
    data = Path(victim).read_bytes()
    with open(victim, "wb") as f:  # flipped byte in the tensor data
        f.write(data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:])
    with pytest.raises(CheckpointError, match=f"{files[1]} is corrupted: checksum"):
        CheckpointReader(root)
    with open(victim, "wb") as f:  # truncated
        f.write(data[:-8])
    with pytest.raises(
        CheckpointError,
        match=f"{files[1]} has {len(data) - 8} bytes, the index records {len(data)}",
    ):
        CheckpointReader(root)
    os.remove(victim)
    with pytest.raises(CheckpointError, match=f"{files[1]} is missing"):
        CheckpointReader(root)
    with open(victim, "wb") as f:
        f.write(data)
    CheckpointReader(root)
    os.remove(os.path.join(path, "index.json"))
    with pytest.raises(CheckpointError, match="index.json is missing"):
        CheckpointReader(root)


def test_index_from_another_model_and_model_checks(tmp_path):
    root, path, _ = _corrupt_root(tmp_path)
    other = str(tmp_path / "other")
    save(
        other,
        "t",
        [ShardItem.whole("a", full("a", (8, 5))), ShardItem.whole("b", full("b", (300,)))],
        {},
    )
    idx = Path(other, "t", "index.json").read_bytes()
    with open(os.path.join(path, "index.json"), "wb") as f:
        f.write(idx)
    with pytest.raises(CheckpointError, match=r"checkpoint file .*rank00000.safetensors"):
        CheckpointReader(root)  # nothing is loaded: the constructor refuses
    # an index edited to describe other shapes fails its own fingerprint check (an index without its own
    # checksum, as written before it was added; with it, tests/test_checkpoint_refusals.py shows the edit refused first)
    doc = json.loads(idx)
    doc.pop("index_checksum")
    doc["tensors"]["a"]["shape"] = [8, 6]
    doc["tensors"]["a"]["slices"][0]["lengths"] = [8, 6]
    with open(os.path.join(other, "t", "index.json"), "w") as f:
        json.dump(doc, f)
    with pytest.raises(CheckpointError, match="model fingerprint"):
        CheckpointReader(other)
    root2 = str(tmp_path / "fresh")
    save(
        root2,
        "t",
        [
            ShardItem.whole("a", full("a", (8, 4))),
            ShardItem.whole("b", torch.ones(3)),
            ShardItem.whole(optimizer_key("exp_avg", "a"), torch.ones(8, 4)),
        ],
        {},
    )
    r = CheckpointReader(root2, model=model_fingerprint({"a": (8, 4), "b": (3,)}))
    assert r.fingerprint == model_fingerprint({"a": [8, 4], "b": [3], "optimizer.master.a": [1]})
    with pytest.raises(CheckpointError, match="another model"):
        CheckpointReader(root2, model=model_fingerprint({"a": (8, 5), "b": (3,)}))
    with pytest.raises(
        CheckpointError, match=r"tensor 'a' has shape \[8, 4\], the model expects \[4, 8\]"
    ):
        r.check_model({"a": (4, 8), "b": (3,)}, strict=False)
    with pytest.raises(CheckpointError, match=r"missing \['c'\], unexpected \['b'\]"):
        r.check_model({"a": (8, 4), "c": (1,)})
    report = r.check_model({"a": (8, 4), "c": (1,)}, strict=False)
    assert report.missing == ["c"] and report.unexpected == ["b"]


def test_reads_touch_only_overlapping_files(tmp_path):
    root, path, files = _corrupt_root(tmp_path)
    r = CheckpointReader(root, verify="size")
    a_files = {s["file"] for s in r.index["tensors"]["a"]["slices"] if s["offsets"][0] == 0}
    for f in files:  # scramble (same size) every file the box [0:4, 1:3] of 'a' does not need
        if f not in a_files:
            p = os.path.join(path, f)
            n = os.path.getsize(p)
            with open(p, "r+b") as fh:
                fh.seek(n - 16)
                fh.write(b"\xff" * 16)
    assert torch.equal(r.read("a", (0, 1), (4, 2)), full("a", (8, 4))[:4, 1:3])
    lazy = CheckpointReader(root, verify="lazy")
    assert torch.equal(lazy.read("a", (0, 1), (4, 2)), full("a", (8, 4))[:4, 1:3])
    with pytest.raises(CheckpointError, match="is corrupted"):
        lazy.read("b")


def test_keep_last_prunes_and_never_the_latest(tmp_path):
    root = str(tmp_path)
    writer = CheckpointWriter(root, keep_last=2)
    for step in range(4):
        writer.save(f"step{step}", _simple_items(), {"step": step})
    assert sorted(os.listdir(root)) == ["latest", "step2", "step3"]
    writer.save("step1", _simple_items(), {"step": 1})  # re-saving an old tag makes it the newest
    assert sorted(list_tags(root)) == ["step1", "step3"] and read_latest(root) == "step1"
    writer.save("step1", _simple_items(), {"step": 11})  # replace the tag latest names
    assert CheckpointReader(root).meta == {"step": 11} and sorted(list_tags(root)) == [
        "step1",
        "step3",
    ]
    assert not [e for e in os.listdir(root) if e.startswith(".")]


def test_async_save_is_identical_and_serialised(tmp_path):
    sync_root, async_root = str(tmp_path / "s"), str(tmp_path / "a")
    items = _simple_items()
    save(sync_root, "x", items, {"step": 1})
    writer = CheckpointWriter(async_root)
    src = full("a", (6, 4))
    live = [
        ShardItem("a", src[:2], (6, 4), (0, 0)),
        ShardItem("a", src[2:], (6, 4), (2, 0)),
    ] + items[2:]
    first = writer.save("x", live, {"step": 1}, async_=True)
    src.zero_()  # the host copy was taken before save returned
    second = writer.save("y", items, {"step": 2}, async_=True)  # waits for the first
    assert first.done()
    second.wait()
    for name in ("rank00000.safetensors", "meta.json"):
        assert Path(sync_root, "x", name).read_bytes() == Path(async_root, "x", name).read_bytes()
    i_sync = json.loads(Path(sync_root, "x", "index.json").read_text())
    i_async = json.loads(Path(async_root, "x", "index.json").read_text())
    for doc in (i_sync, i_async):
        doc.pop("saved_at"), doc.pop("index_checksum")  # the checksum covers saved_at
    assert i_sync == i_async and read_latest(async_root) == "y"
    assert torch.equal(CheckpointReader(async_root, "x").read("a"), full("a", (6, 4)))


# ----------------------------------------------------------------------------- crash safety

_CHILD = textwrap.dedent("""
    import sys, torch
    from plait.checkpoint import ShardItem, save
    root, tag = sys.argv[1], sys.argv[2]
    items = [ShardItem.whole(f"t{i}", torch.full((64, 64), float(i))) for i in range(3)]
    save(root, tag, items, {"step": "new"})
""")


@pytest.mark.parametrize(
    "phase,tag", [("file", "new"), ("index", "new"), ("rename", "old"), ("latest", "new")]
)
def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path, phase, tag):
    root = str(tmp_path / "ck")
    save(root, "old", _simple_items(), {"step": "old"})
    marker = str(tmp_path / "paused")
    env = dict(
        os.environ,
        PLAIT_CHECKPOINT_TEST_PAUSE=f"{phase}:{marker}",
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    child = subprocess.Popen([sys.executable, "-c", _CHILD, root, tag], env=env)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(marker):
            assert child.poll() is None, f"child exited with {child.returncode} before pausing"
            assert time.monotonic() < deadline, "child never reached the pause point"
            time.sleep(0.02)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    assert read_latest(root) == "old"
    r = CheckpointReader(root)
    assert r.tag == "old" and r.meta == {"step": "old"}
    assert torch.equal(r.read("a"), full("a", (6, 4)))
    save(root, "next", _simple_items(), {"step": "next"})  # the next save clears the leftovers
    assert not [e for e in os.listdir(root) if e.startswith(".")]
    assert sorted(list_tags(root)) == (
        ["next", "old"] if phase != "latest" else ["new", "next", "old"]
    )
