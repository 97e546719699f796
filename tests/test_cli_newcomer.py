"""The command line a new user reaches for: ``check-config`` on the repo's own configs, naming its flags and
noting flags the file overrides; ``convert reshard`` offline; a missing folder reported as missing;
``inspect | head`` without "Broken pipe". (GGUF import: tests/test_convert_hf.py's SmolLM2 fixture.)"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

from plait.checkpoint import CheckpointReader, CheckpointWriter, ShardItem
from plait.cli import cli_words, main

ROOT = Path(__file__).resolve().parents[1]
ZERO3 = str(ROOT / "examples" / "configs" / "zero3_bf16.json")


def test_check_config_accepts_the_repos_zero3_config_and_says_what_stays_open(capsys):
    assert main(["check-config", ZERO3]) == 0
    out, err = capsys.readouterr()
    cfg = json.loads(out)
    assert (
        cfg["zero_optimization"]["stage"] == 3
        and cfg["zero_optimization"]["reduce_bucket_size"] == "auto"
    )
    assert cfg["train_batch_size"] == 32  # 4 x 8 x dp 1
    assert "(pass --hidden H to see the numbers)" in err and "checked at --dp 1; pass --dp N" in err
    assert main(["check-config", ZERO3, "--dp", "8", "--hidden", "64"]) == 0
    cfg = json.loads(capsys.readouterr().out)
    assert (
        cfg["train_batch_size"] == 256 and cfg["zero_optimization"]["reduce_bucket_size"] == 64 * 64
    )


def test_check_config_notes_flags_the_file_overrides(capsys):
    assert (
        main(
            [
                "check-config",
                ZERO3,
                "--dp",
                "8",
                "--hidden",
                "64",
                "--lr",
                "1",
                "--precision",
                "fp16",
                "--warmup-steps",
                "3",
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    assert json.loads(out)["optimizer"]["params"]["lr"] == 3e-4
    notes = [line for line in err.splitlines() if "is not used" in line]
    assert notes == [
        "plait check-config: note: --lr 1.0 is not used: the file sets optimizer.params.lr = 0.0003 (flags fill "
        'only "auto" values; write "auto" there to take the flag)',
        "plait check-config: note: --precision fp16 is not used: the file sets bf16.enabled = true (flags fill only "
        '"auto" values; write "auto" there to take the flag)',
        "plait check-config: note: --warmup-steps 3 is not used: the file sets scheduler.params.warmup_num_steps = "
        '2000 (flags fill only "auto" values; write "auto" there to take the flag)',
    ]


def test_check_config_errors_name_the_flags_not_python_arguments(tmp_path, capsys):
    cfg = tmp_path / "ds.json"
    cfg.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": 2,
                "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
            }
        )
    )
    assert main(["check-config", str(cfg)]) == 2
    assert capsys.readouterr().err == (
        f"plait check-config: {cfg}: 'optimizer.params.lr' is \"auto\" but nothing "
        f"resolves it; pass --lr, or write a number in the config\n"
    )
    assert main(["check-config", str(tmp_path / "nope.json")]) == 2
    assert (
        capsys.readouterr().err == f"plait check-config: no such file: {tmp_path / 'nope.json'}\n"
    )
    assert (
        cli_words("pass dp_size= (or world_size=) to load_config, or")
        == "pass --dp (or --world-size), or"
    )


@pytest.fixture(scope="module")
def two_rank_checkpoint(tmp_path_factory):
    """A checkpoint with every tensor in two slices (as two writer ranks leave it), 1200 tensors (a listing
    longer than a pipe's 64 KiB buffer)."""
    root = tmp_path_factory.mktemp("ckpt") / "run"
    items = [
        ShardItem(
            f"layers.{i}.weight",
            torch.arange(8.0).reshape(4, 2)[2 * half : 2 * half + 2] + i,
            (4, 2),
            (2 * half, 0),
        )
        for i in range(1200)
        for half in (0, 1)
    ]
    CheckpointWriter(str(root)).save(
        "step3", items, {"engine": {"global_steps": 3}}, rank_meta={"rank": 0}
    ).wait()
    return root


def test_reshard_offline_writes_whole_tensors_in_files_of_a_given_size(
    two_rank_checkpoint, tmp_path, capsys
):
    assert (
        main(
            [
                "convert",
                "reshard",
                str(two_rank_checkpoint),
                str(tmp_path / "new"),
                "--max-file-size",
                "20KB",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith(
        f"wrote {tmp_path / 'new' / 'step3'}: 1200 tensors whole (were 2400 slices) in 2 file(s)\n"
    )
    new, old = CheckpointReader(str(tmp_path / "new")), CheckpointReader(str(two_rank_checkpoint))
    assert (
        new.tag == "step3"
        and new.meta == old.meta
        and new.rank_meta() == old.rank_meta() == [{"rank": 0}]
    )
    assert all(
        len(new.index["tensors"][n]["slices"]) == 1 and torch.equal(new.read(n), old.read(n))
        for n in old.names()
    )


def test_missing_folders_are_reported_as_missing(tmp_path, capsys):
    for argv, what in (
        (["from-hf", str(tmp_path / "nope"), str(tmp_path / "x")], "Hugging Face model folder"),
        (["to-hf", str(tmp_path / "nope"), str(tmp_path / "x")], "checkpoint root"),
        (["inspect", str(tmp_path / "nope")], "checkpoint root"),
    ):
        assert main(["convert", *argv]) == 2
        assert (
            capsys.readouterr().err
            == f"plait convert {argv[0]}: no such {what}: {tmp_path / 'nope'}\n"
        )
    assert main(["convert", "from-hf", str(tmp_path), str(tmp_path / "x")]) == 2
    assert (
        "holds neither a config.json with safetensors weights nor a .gguf file"
        in capsys.readouterr().err
    )


def test_inspect_piped_into_head_ends_quietly(two_rank_checkpoint, capsys):
    """``plait convert inspect ROOT | head``: the reader has left; the listing stops with SIGPIPE's status
    (141, as other tools), no "Broken pipe" traceback or message."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # head has read its lines and exited
    with open(write_end, "w") as pipe, contextlib.redirect_stdout(pipe):
        assert main(["convert", "inspect", str(two_rank_checkpoint)]) == 141
    assert capsys.readouterr().err == ""
