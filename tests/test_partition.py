"""Partitioning the layer list over pipeline stages: uniform, by parameter count, explicit
boundaries, the error messages, and that a stage builds only its own layers (no processes)."""

import itertools

import pytest

from plait.layers import TransformerModel
from plait.models import preset
from plait.layers.stages import build_stage_modules, layer_parameter_counts
from plait.parallel.pipeline.partition import partition_layers, stage_layers
from plait.parallel.sharding import logical_numel


def sizes(parts):
    return [b - a for a, b in parts]


def test_uniform_is_contiguous_and_balanced():
    for n in range(1, 40):
        for p, v in ((1, 1), (2, 1), (4, 1), (2, 2), (4, 2), (8, 1)):
            if n < p * v:
                continue
            parts = partition_layers(n, p, v)
            assert len(parts) == p * v and parts[0][0] == 0 and parts[-1][1] == n
            assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
            assert max(sizes(parts)) - min(sizes(parts)) <= 1 and min(sizes(parts)) >= 1
    assert partition_layers(8, 2, 2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert sizes(partition_layers(10, 4)) == [3, 2, 3, 2]


def test_parameters_balances_weights():
    # a heavy embedding and head (vocab) and light blocks: the ends get fewer layers
    weights = [10, 1, 1, 1, 1, 1, 1, 10]
    parts = partition_layers(8, 2, 1, "parameters", weights)
    assert parts == [(0, 4), (4, 8)]
    parts = partition_layers(8, 3, 1, "parameters", weights)
    loads = [sum(weights[a:b]) for a, b in parts]
    assert parts == [(0, 1), (1, 7), (7, 8)] and max(loads) == 10  # optimum: [10 | 6 x 1 | 10]
    assert partition_layers(4, 4, 1, "parameters", [5, 1, 1, 5]) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_parameter_counts_from_config_without_materializing():
    cfg = preset("gpt2-tiny", vocab_size=1001, num_layers=3, hidden_size=32, num_heads=4)
    counts = layer_parameter_counts(cfg)
    h, f = 32, 128
    block = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    assert counts == [1001 * h + 256 * h, block, block, block, 2 * h + 1001 * h]
    full = TransformerModel(cfg, None, device="meta")
    tied_once = logical_numel(full)
    assert (
        sum(counts) == tied_once + 1001 * h
    )  # the head's copy of the tied weight counted on its stage
    llama = preset("llama-tiny", vocab_size=1001, num_layers=2)
    assert len(layer_parameter_counts(llama)) == 4
    # the big head of an untied llama lands alone on the last stage
    parts = partition_layers(4, 2, 1, "parameters", layer_parameter_counts(llama))
    assert parts[-1][1] - parts[-1][0] <= 2


def test_explicit_boundaries_and_uneven_splits():
    assert partition_layers(8, 2, 1, [0, 5, 8]) == [(0, 5), (5, 8)]
    assert partition_layers(8, 2, 2, (0, 1, 2, 7, 8)) == [(0, 1), (1, 2), (2, 7), (7, 8)]
    # chunk c of rank r is virtual stage c*p + r
    parts = partition_layers(8, 2, 2, [0, 1, 2, 7, 8])
    assert stage_layers(parts, 2, 0) == [range(1), range(2, 7)]
    assert stage_layers(parts, 2, 1) == [range(1, 2), range(7, 8)]


@pytest.mark.parametrize(
    "args, match",
    [
        ((5, 4, 2), r"cannot split 5 layers .* p x v = 4 x 2 = 8 pipeline stages"),
        ((3, 4, 1), r"3 layers .* 4 x 1 = 4"),
        ((8, 2, 1, [0, 4]), r"needs p x v \+ 1 = 3 boundaries for 2 stages, got 2"),
        ((8, 2, 1, [0, 4, 7]), r"start at 0 and end at 8 .* got \[0, 4, 7\]"),
        ((8, 2, 1, [1, 4, 8]), r"start at 0 and end at 8"),
        ((8, 3, 1, [0, 5, 5, 8]), r"strictly increase .* stage 1 is \[5, 5\)"),
        ((8, 3, 1, [0, 6, 4, 8]), r"stage 1 is \[6, 4\)"),
        ((8, 2, 1, "parameters"), r"needs one weight per layer \(8\), got none"),
        ((8, 2, 1, "params"), r"unknown partition method 'params'"),
        ((8, 0, 1), r"p must be a positive integer, got 0"),
    ],
)
def test_errors_name_the_numbers(args, match):
    with pytest.raises(ValueError, match=match):
        partition_layers(*args)


def test_stage_builds_only_its_own_layers():
    """A 64-block model cut over pp=8: each stage builds its layers and nothing else."""

    class FakeMesh:  # the fields build_stage_modules and TransformerModel read; one process
        pp, tp, dp, cp, tp_group, cp_group, tp_rank, cp_rank = 8, 1, 1, 1, None, None, 0, 0

        def __init__(self, rank):
            self.pp_rank = rank

    cfg = preset(
        "llama-tiny",
        vocab_size=1001,
        num_layers=64,
        hidden_size=16,
        num_heads=2,
        num_kv_heads=1,
        ffn_hidden_size=32,
    )
    parts = partition_layers(66, 8)
    seen = []
    for rank in (0, 3, 7):
        (chunk,) = build_stage_modules(cfg, FakeMesh(rank), seed=3)
        want = list(range(*parts[rank]))
        assert chunk.layer_indices == want and sorted(map(int, chunk.layers)) == want
        names = {n.split(".")[1] for n, _ in chunk.named_parameters()}
        assert names == {str(i) for i in want}
        seen.append(chunk)
    assert seen[0].layer_indices[0] == 0 and not seen[0].has_head and seen[2].has_head
    # v=2: rank 1 holds stages 1 and 9 of 16
    chunks = build_stage_modules(cfg, FakeMesh(1), v=2, method="parameters", seed=3)
    parts2 = partition_layers(66, 8, 2, "parameters", layer_parameter_counts(cfg))
    assert [c.layer_indices for c in chunks] == [list(range(*parts2[1])), list(range(*parts2[9]))]
