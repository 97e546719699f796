"""plait.config: the batch triple (train_batch_size = micro x accumulation x dp) derived from what is given, and
dp derived from the world size and the tensor/pipeline sizes."""

import pytest

from plait.config import ConfigError, load_config


@pytest.mark.parametrize(
    "given, dp, expected",
    [
        ({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 4}, 8, (256, 4, 8)),
        ({"train_batch_size": 256, "gradient_accumulation_steps": 4}, 8, (256, 8, 4)),
        ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}, 8, (256, 4, 8)),
        ({"train_micro_batch_size_per_gpu": 4}, 8, (32, 4, 1)),
        ({"train_batch_size": 64}, 8, (64, 8, 1)),
        (
            {
                "train_batch_size": 256,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 8,
            },
            8,
            (256, 4, 8),
        ),
        (
            {
                "train_batch_size": 256,
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": 8,
            },
            None,
            (256, 4, 8),
        ),
    ],
)
def test_batch_triple_derivation(given, dp, expected):
    cfg = load_config(given, dp_size=dp)
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == expected
    assert cfg.data_parallel_size == expected[0] // (expected[1] * expected[2])


def test_batch_triple_inconsistency_names_all_four_numbers_and_the_fix():
    bad = {
        "train_batch_size": 100,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 8,
    }
    with pytest.raises(ConfigError) as err:
        load_config(bad, dp_size=8)
    msg = str(err.value)
    for part in (
        "train_batch_size (100)",
        "train_micro_batch_size_per_gpu (4)",
        "gradient_accumulation_steps (8)",
        "dp (8)",
        "4 x 8 x 8 = 256 != 100",
        "change one",
    ):
        assert part in msg, msg
    with pytest.raises(
        ConfigError,
        match=r"cannot derive gradient_accumulation_steps.*\(100\).*100 is not "
        r"divisible by 4 x 8",
    ):
        load_config({"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4}, dp_size=8)
    with pytest.raises(ConfigError, match="pass dp_size="):
        load_config({"train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ConfigError, match="set train_batch_size or train_micro_batch_size_per_gpu"):
        load_config({"gradient_accumulation_steps": 4}, dp_size=2)


def test_dp_from_world_size_and_pipeline_micro_batches():
    raw = {
        "train_micro_batch_size_per_gpu": 2,
        "tensor_parallel": {"size": 2},
        "pipeline": {
            "stages": 4,
            "schedule": "interleaved",
            "virtual_stages": 2,
            "micro_batches": 8,
        },
    }
    cfg = load_config(raw, world_size=32)  # dp = 32 / (2 x 4) = 4
    assert cfg.pipeline.size == 4 and cfg.pipeline.num_chunks == 8
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps, cfg.pipeline.micro_batches) == (
        64,
        8,
        8,
    )
    with pytest.raises(
        ConfigError,
        match=r"world_size \(30\) is not divisible by tensor_parallel.size \(2\) x "
        r"pipeline.size \(4\)",
    ):
        load_config(raw, world_size=30)
    for m in (
        6,
        3,
    ):  # interleaved takes any m >= 1, not only multiples of pipeline.size (m < size: mostly bubble)
        odd = load_config(
            {**raw, "pipeline": {**raw["pipeline"], "micro_batches": m}}, world_size=32
        )
        assert (
            odd.train_batch_size,
            odd.gradient_accumulation_steps,
            odd.pipeline.micro_batches,
        ) == (8 * m, m, m)
    with pytest.raises(
        ConfigError,
        match=r"pipeline.micro_batches \(8\) differs from gradient_accumulation_steps "
        r"\(2\)",
    ):
        load_config({**raw, "gradient_accumulation_steps": 2}, world_size=32)
    with pytest.raises(ConfigError, match=r"4 strictly increasing layer indices"):
        load_config(
            {"train_batch_size": 8, "pipeline": {"size": 3, "partition": [0, 5, 3, 9]}}, dp_size=1
        )


def test_a_config_without_batch_sizes_takes_the_callers():
    """The Hugging Face test configs give no batch key at all: the Trainer's batch size is the one."""
    cfg = load_config(
        {"zero_optimization": {"stage": 3}},
        dp_size=2,
        micro_batch_size=4,
        gradient_accumulation_steps=3,
    )
    assert (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    ) == (24, 4, 3)
