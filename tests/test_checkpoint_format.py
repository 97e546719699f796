"""plait.checkpoint storage layer: multi-rank save, resharding reads, the box arithmetic of flat ranges and tp
shards. Validation and crash safety in one process: tests/test_checkpoint_safety.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from plait.checkpoint import (
    CheckpointError,
    CheckpointReader,
    CheckpointWriter,
    ShardItem,
    flat_range_boxes,
    list_tags,
    optimizer_key,
    read_latest,
    read_tp_shard,
    save,
    tensor_from_json,
    tensor_to_json,
    tp_box,
    tp_shard_item,
)
from plait.checkpoint.boxes import check_tiling
from plait.parallel.sharding import TPShard
from plait.testing import run_distributed
from checkpoint_helpers import full

SHAPES = {
    "w0": (10, 6),
    "w1": (5, 9),
    "bf": (8, 4),
    "rep": (3, 3),
    "flat": (6, 7),
    optimizer_key("exp_avg", "w0"): (10, 6),
}


def _dtype(name):
    return torch.bfloat16 if name == "bf" else torch.float32


def _items_4(rank: int, world: int) -> list[ShardItem]:
    """Rank's boxes: dim-0 uneven (padded) split, dim-1 split with an all-padding rank, 2x2 grid
    in bf16, replicated (rank 0 only), ZeRO-style flat range, optimizer state."""
    items = []
    for name in ("w0", optimizer_key("exp_avg", "w0")):
        spec = TPShard((10, 6), dim=0, padded=12, rank=rank, world=world)
        items.append(tp_shard_item(name, spec.shard(full(name, (10, 6))), spec))
    spec = TPShard((5, 9), dim=1, padded=12, rank=rank, world=world)
    item = tp_shard_item("w1", spec.shard(full("w1", (5, 9))), spec)
    if item is not None:  # with world 4 rank 3 holds only padding
        items.append(item)
    bf = full("bf", (8, 4), torch.bfloat16)
    if world == 4:  # 2x2 grid of [4, 2] boxes
        rows, cols = (rank // 2) * 4, (rank % 2) * 2
        items.append(ShardItem("bf", bf[rows : rows + 4, cols : cols + 2], (8, 4), (rows, cols)))
    else:  # 2 ways along dim 1
        items.append(ShardItem("bf", bf[:, rank * 2 : rank * 2 + 2], (8, 4), (0, rank * 2)))
    if rank == 0:
        items.append(ShardItem.whole("rep", full("rep", (3, 3))))
    flat = full("flat", (6, 7)).reshape(-1)
    bounds = [0, 11, 22, 33, 42] if world == 4 else [0, 23, 42]
    items += ShardItem.from_flat(
        "flat", flat[bounds[rank] : bounds[rank + 1]], (6, 7), bounds[rank]
    )
    return items


def _save_world(root: str):
    rank, world = dist.get_rank(), dist.get_world_size()
    rng = tensor_to_json(torch.tensor([rank, 7], dtype=torch.int64))
    save(
        root,
        "step5",
        _items_4(rank, world),
        {"step": 5, "client_state": {"epoch": 1}},
        rank_meta={"rng": rng},
    )
    # every rank reads back its shard at a *different* layout (tp=3 along dim 1 of w0)
    r = CheckpointReader(root)
    spec = TPShard((10, 6), dim=1, rank=rank % 3, world=3)
    mine = read_tp_shard(r, "w0", spec)
    return bool(torch.equal(mine, spec.shard(full("w0", (10, 6))))), sorted(os.listdir(r.path))


def _check_any_layout(root: str):
    r = CheckpointReader(root)
    assert r.meta == {"step": 5, "client_state": {"epoch": 1}}
    assert [tensor_from_json(m["rng"]).tolist()[0] for m in r.rank_meta()] == list(
        range(len(r.rank_meta()))
    )
    for name, shape in SHAPES.items():
        want = full(name, shape, _dtype(name))
        assert r.shape(name) == shape and r.dtype(name) == _dtype(name)
        assert torch.equal(r.read(name), want), name
        for k in range(3):  # read as 3 boxes along dim 1 (any split other than the saved one)
            lo, hi = k * shape[1] // 3, (k + 1) * shape[1] // 3
            assert torch.equal(r.read(name, (0, lo), (shape[0], hi - lo)), want[:, lo:hi]), name
        assert torch.equal(r.read(name, (1, 2), (shape[0] - 2, 1)), want[1:-1, 2:3])
        n = want.numel()
        assert torch.equal(
            r.read_flat(name, n // 4 + 1, n - 2), want.reshape(-1)[n // 4 + 1 : n - 2]
        )
    assert len(r.index["tensors"]["rep"]["slices"]) == 1  # replicated: written once
    assert torch.equal(r.read("w0", dtype=torch.float64), full("w0", (10, 6)).double())
    for rank in range(3):  # vocabulary-style padded load at tp=3: [5, 12/3=4] with zero padding
        spec = TPShard((5, 9), dim=1, padded=12, rank=rank, world=3)
        assert torch.equal(read_tp_shard(r, "w1", spec), spec.shard(full("w1", (5, 9))))
    return r


@pytest.mark.parametrize("world", [2, 4])
def test_multi_rank_save_reads_back_in_any_layout(tmp_path, world):
    results = run_distributed(_save_world, world, str(tmp_path))
    assert all(ok for ok, _ in results)
    files = results[0][1]
    assert files == sorted(
        ["index.json", "meta.json", "rank_meta.json"]
        + [f"rank{r:05d}.safetensors" for r in range(world)]
    )
    assert read_latest(str(tmp_path)) == "step5"
    assert [e for e in os.listdir(tmp_path) if e.startswith(".")] == []
    _check_any_layout(str(tmp_path))


def _save_errors(root: str):
    rank = dist.get_rank()
    out = []
    good = [ShardItem("t", full("t", (4, 6))[:, rank * 3 : rank * 3 + 3], (4, 6), (0, rank * 3))]
    save(root, "ok", good, {"step": 1})
    # both ranks pass a replicated tensor -> every rank fails, naming it
    try:
        save(root, "bad", good + [ShardItem.whole("rep", torch.ones(2))], {"step": 2})
    except CheckpointError as e:
        out.append(str(e))
    # only rank 1's rank_meta is not JSON -> every rank fails, naming rank 1 and the key path
    try:
        save(
            root, "bad", good, {"step": 2}, rank_meta={"rng": torch.ones(2)} if rank == 1 else None
        )
    except CheckpointError as e:
        out.append(str(e))
    # async: rank 1 sees its error at once, rank 0 at wait()
    writer = CheckpointWriter(root)
    try:
        writer.save("bad", good, {"x": {1: 2}} if rank == 1 else {}, async_=True).wait()
    except CheckpointError as e:
        out.append(str(e))
    writer.wait()
    before = (read_latest(root), sorted(list_tags(root)))
    writer.save("async_ok", good, {"step": 3}, async_=True).wait()  # on the writer's side group
    return out, before, read_latest(root)


def test_multi_rank_errors_raise_on_every_rank_and_keep_previous(tmp_path):
    for errors, (latest, tags), after in run_distributed(_save_errors, 2, str(tmp_path)):
        assert len(errors) == 3
        assert "'rep'" in errors[0] and "overlaps" in errors[0]
        assert (
            "rank 1" in errors[1]
            and "rank_meta['rng']" in errors[1]
            and "torch.Tensor" in errors[1]
        )
        assert "key 1" in errors[2] and "meta['x']" in errors[2]
        assert latest == "ok" and tags == ["ok"] and after == "async_ok"
    assert torch.equal(CheckpointReader(str(tmp_path)).read("t"), full("t", (4, 6)))
    assert CheckpointReader(str(tmp_path)).meta == {"step": 3}


# ----------------------------------------------------------------------------- boxes and tp


def test_flat_range_boxes_cover_exactly_the_range():
    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)]:
        n = torch.Size(shape).numel()
        ref = torch.arange(n).reshape(shape)
        for _ in range(40):
            start, stop = sorted(torch.randint(0, n + 1, (2,), generator=g).tolist())
            boxes = flat_range_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            got = [ref[tuple(slice(o, o + m) for o, m in zip(*b))].reshape(-1) for b in boxes]
            assert (torch.cat(got).tolist() if got else []) == list(range(start, stop))


def test_check_tiling_reports_overlap_and_gap():
    check_tiling("w", (4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2)), ((2, 2), (2, 2))])
    with pytest.raises(CheckpointError, match=r"'w'.*overlaps"):
        check_tiling("w", (4, 4), [((0, 0), (3, 4)), ((2, 0), (2, 4))])
    with pytest.raises(CheckpointError, match=r"cover 12 of 16 elements \(4 missing\)"):
        check_tiling("w", (4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 2))])


def test_tp_helpers_round_trip_between_tp_sizes(tmp_path):
    root = str(tmp_path)
    vocab = full("emb", (50, 8))
    items = []
    for rank in range(4):  # saved at tp=4 with the vocabulary padded to 64
        spec = TPShard((50, 8), dim=0, padded=64, rank=rank, world=4)
        assert tp_box(spec) == ((min(16 * rank, 50), 0), (min(16, max(0, 50 - 16 * rank)), 8))
        item = tp_shard_item("emb", spec.shard(vocab), spec)
        items += [item] if item is not None else []
    save(root, "t", items + [tp_shard_item("norm", torch.ones(8), TPShard((8,)))], {})
    r = CheckpointReader(root)
    for rank in range(3):  # loaded at tp=3 with padding to 51
        spec = TPShard((50, 8), dim=0, padded=51, rank=rank, world=3)
        assert torch.equal(read_tp_shard(r, "emb", spec), spec.shard(vocab))
    assert torch.equal(read_tp_shard(r, "norm", TPShard((8,))), torch.ones(8))
    with pytest.raises(CheckpointError, match=r"'emb'.*logical shape \[50, 8\].*expects \[52, 8\]"):
        read_tp_shard(r, "emb", TPShard((52, 8), dim=0, rank=0, world=4))
