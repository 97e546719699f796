"""``plait.hf.Trainer`` checkpoints under faults: a save killed or out of disk midway publishes nothing, and
resuming passes over (naming it) or refuses (naming the last complete one) a ``checkpoint-N`` left incomplete
or damaged, as an older plait left them when killed before its last write (``trainer_state.json``).

A resumed run continues the uninterrupted one exactly: the checkpoint holds the fp32 masters, Adam's moments,
the schedule, the RNG and the data position, so its losses are compared with ``==``.
"""

import errno
import os
import re
import shutil
import time

import pytest
import torch
import torch.distributed as dist
import transformers
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import get_last_checkpoint

from plait.checkpoint import CheckpointError
from plait.hf import Trainer, TrainingArguments
from plait.testing import run_distributed

CONFIG = {
    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    "zero_optimization": {"stage": 2},
}
DATA = [
    {"input_ids": [i % 64, (3 * i) % 64, 5, 7], "labels": [i % 64, (3 * i) % 64, 5, 7]}
    for i in range(16)
]


class Killed(BaseException):
    """Stands for kill -9: nothing after the raise runs (no handler catches a BaseException)."""


def tiny_llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )


def train(out, resume=None, steps=4, trainer_class=Trainer, **extra):
    """{step: logged loss} of a run saving every 2 steps into ``out``."""
    args = TrainingArguments(
        output_dir=str(out),
        deepspeed=CONFIG,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_steps=steps,
        save_steps=2,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=3,
        disable_tqdm=True,
        **extra,
    )
    trainer = trainer_class(model=tiny_llama(), args=args, train_dataset=DATA)
    trainer.train(resume_from_checkpoint=resume)
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The uninterrupted run: (its losses, its output_dir holding checkpoint-2 and checkpoint-4)."""
    out = tmp_path_factory.mktemp("full")
    losses = train(out)
    assert sorted(losses) == [1, 2, 3, 4] and losses[3] != losses[4]
    return losses, out


def entries(out):
    return sorted(os.listdir(out))


def partial_copy(full_out, step, out, drop):
    """``out/checkpoint-<step>`` as a killed save of an older plait left it: the complete one less ``drop``."""
    shutil.copytree(full_out / f"checkpoint-{step}", out / f"checkpoint-{step}")
    target = out / f"checkpoint-{step}" / drop
    shutil.rmtree(target) if target.is_dir() else target.unlink()


@pytest.mark.parametrize("fault", ["kill", "disk-full"])
def test_a_save_that_dies_midway_publishes_nothing_and_resume_continues_exactly(
    full, fault, tmp_path, monkeypatch
):
    losses, _ = full
    save_to_json = TrainerState.save_to_json

    def dying(state, path):
        if (
            state.global_step == 4
        ):  # the last write of checkpoint-4: the engine, model and RNG files are written
            raise (
                Killed()
                if fault == "kill"
                else OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            )
        save_to_json(state, path)

    monkeypatch.setattr(TrainerState, "save_to_json", dying)
    with pytest.raises(Killed if fault == "kill" else CheckpointError) as err:
        train(tmp_path)
    monkeypatch.undo()
    left = [e for e in entries(tmp_path) if e.startswith(".tmp-checkpoint-4-")]
    assert [e for e in entries(tmp_path) if not e.startswith(".")] == ["checkpoint-2"]
    assert get_last_checkpoint(str(tmp_path)) == str(
        tmp_path / "checkpoint-2"
    )  # transformers' own search
    if fault == "kill":
        assert len(left) == 1  # the killed save's folder, under a name nothing resumes from
    else:
        assert left == []
        tmp = re.escape(str(tmp_path / ".tmp-checkpoint-4-")) + "[0-9a-f]{12}"
        assert re.fullmatch(
            rf"saving checkpoint {re.escape(str(tmp_path / 'checkpoint-4'))} failed: rank 0: OSError: "
            rf"\[Errno 28\] No space left on device: '{tmp}/trainer_state\.json'\. Nothing was "
            rf"published; the newest complete checkpoint is still {re.escape(str(tmp_path))}/checkpoint-2",
            str(err.value),
        ), str(err.value)
    resumed = train(tmp_path, resume=True)
    assert {s: resumed[s] for s in (3, 4)} == {s: losses[s] for s in (3, 4)}
    assert entries(tmp_path) == [
        "checkpoint-2",
        "checkpoint-4",
    ]  # the next save removed the leftover


def test_resume_true_passes_over_incomplete_folders_naming_each(full, tmp_path, caplog):
    losses, full_out = full
    shutil.copytree(full_out / "checkpoint-2", tmp_path / "checkpoint-2")
    partial_copy(full_out, 4, tmp_path, "trainer_state.json")
    shutil.copytree(full_out / "checkpoint-4", tmp_path / "checkpoint-6")
    shutil.rmtree(tmp_path / "checkpoint-6" / "global_step4")  # the engine's shards never arrived
    resumed = train(tmp_path, resume=True)
    assert {s: resumed[s] for s in (3, 4)} == {s: losses[s] for s in (3, 4)}
    warned = [r.getMessage() for r in caplog.records if "passing over" in r.getMessage()]
    assert warned == [
        f"resume_from_checkpoint=True: passing over {tmp_path / 'checkpoint-6'}, damaged or incomplete: its engine "
        f"checkpoint is missing (checkpoint {tmp_path / 'checkpoint-6' / 'global_step4'} does not exist (available: "
        f"[])); resuming from {tmp_path / 'checkpoint-2'}",
        f"resume_from_checkpoint=True: passing over {tmp_path / 'checkpoint-4'}, damaged or incomplete: it has no "
        f"trainer_state.json (a save that did not finish); resuming from {tmp_path / 'checkpoint-2'}",
    ]
    assert (tmp_path / "checkpoint-4" / "trainer_state.json").is_file()  # saved again, whole
    assert entries(tmp_path) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_save_total_limit_never_keeps_a_partial_folder_in_place_of_the_newest_complete_one(
    full, tmp_path
):
    """A partial ``checkpoint-6`` (a crashed longer run) counts for nothing: a 4-step run with
    ``save_total_limit=1`` keeps its ``checkpoint-4`` and deletes its ``checkpoint-2``."""
    _, full_out = full
    partial_copy(full_out, 4, tmp_path, "trainer_state.json")
    os.rename(tmp_path / "checkpoint-4", tmp_path / "checkpoint-6")
    train(tmp_path, save_total_limit=1)
    assert entries(tmp_path) == ["checkpoint-4", "checkpoint-6"]
    assert (tmp_path / "checkpoint-4" / "trainer_state.json").is_file()
    assert not (
        tmp_path / "checkpoint-6" / "trainer_state.json"
    ).exists()  # not ours to delete, not counted


def test_an_explicit_incomplete_checkpoint_is_refused_naming_it_and_the_last_complete_one(
    full, tmp_path
):
    _, full_out = full
    shutil.copytree(full_out / "checkpoint-2", tmp_path / "checkpoint-2")
    partial_copy(full_out, 4, tmp_path, "trainer_state.json")
    with pytest.raises(CheckpointError) as err:
        train(tmp_path, resume=str(tmp_path / "checkpoint-4"))
    last = tmp_path / "checkpoint-2"
    assert str(err.value) == (
        f"cannot resume from {tmp_path / 'checkpoint-4'}: the checkpoint is damaged or incomplete: it has no "
        f"trainer_state.json (a save that did not finish). Resume from {last} instead "
        f"(resume_from_checkpoint={str(last)!r}, or True for the newest complete one)"
    )
    assert entries(tmp_path) == ["checkpoint-2", "checkpoint-4"]  # nothing loaded, nothing written


def test_a_truncated_trainer_state_names_the_file_and_the_checkpoint_to_resume_from(full, tmp_path):
    _, full_out = full
    shutil.copytree(full_out, tmp_path / "out")
    state_file = tmp_path / "out" / "checkpoint-4" / "trainer_state.json"
    state_file.write_bytes(state_file.read_bytes()[:40])
    with pytest.raises(CheckpointError) as err:
        train(tmp_path / "out", resume=str(tmp_path / "out" / "checkpoint-4"))
    message = str(err.value)
    assert f"trainer state {state_file} is damaged: not UTF-8 JSON text (" in message
    assert message.endswith(
        f"Resume from {tmp_path / 'out' / 'checkpoint-2'} instead (resume_from_checkpoint="
        f"{str(tmp_path / 'out' / 'checkpoint-2')!r}, or True for the newest complete one)"
    )


class SlowThenFullRank1(Trainer):
    """Rank 1 writes its RNG state last at the step-2 save (late: no rank may rename before it has written)
    and finds its disk full at the step-4 save."""

    def _save_rng_state(self, output_dir):
        if dist.get_rank() == 1 and self.state.global_step == 2:
            time.sleep(0.5)
        if dist.get_rank() == 1 and self.state.global_step == 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), output_dir)
        super()._save_rng_state(output_dir)


def _two_rank_body(out):
    rank = dist.get_rank()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    try:
        train(out, trainer_class=SlowThenFullRank1)
    except CheckpointError as e:
        return str(e), entries(out), entries(out / "checkpoint-2")
    return None


def test_ranks_write_before_the_rename_and_one_full_disk_fails_the_save_on_every_rank(tmp_path):
    """2 gloo ranks: checkpoint-2 holds the late rank's file (the rename waited for it); rank 1's full disk at
    checkpoint-4 raises the same error on both ranks (before: rank 0 waited for rank 1 at a barrier) and
    publishes nothing."""
    results = run_distributed(_two_rank_body, 2, tmp_path, timeout_s=120)
    assert [r[1:] for r in results] == [
        (
            ["checkpoint-2"],
            [
                "config.json",
                "generation_config.json",
                "global_step2",
                "latest",
                "model.safetensors",
                "rng_before_read_ahead_0.json",
                "rng_before_read_ahead_1.json",
                "rng_state_0.pth",
                "rng_state_1.pth",
                "trainer_state.json",
            ],
        )
    ] * 2
    tmp = re.escape(str(tmp_path / ".tmp-checkpoint-4-")) + "[0-9a-f]{12}"
    assert results[0][0] == results[1][0]
    assert re.fullmatch(
        rf"saving checkpoint {re.escape(str(tmp_path / 'checkpoint-4'))} failed: rank 1: OSError: "
        rf"\[Errno 28\] No space left on device: '{tmp}'\. Nothing was published; the newest "
        rf"complete checkpoint is still {re.escape(str(tmp_path))}/checkpoint-2",
        results[0][0],
    )


def test_a_peer_renaming_its_temporary_file_during_the_fsync_pass_is_not_a_failed_save(
    tmp_path, monkeypatch
):
    """CI saw rank 1 fail a save with FileNotFoundError on rank 0's `.tmpXXXX` (an atomic write renamed between
    rank 1's scandir and its fsync): the file moved on is its writer's to sync, the save goes on."""
    from plait.hf import checkpoints

    real = checkpoints.fsync_path

    def peer_renames_first(path):
        if path.endswith(".tmpA") and os.path.exists(path):
            os.rename(
                path, os.path.join(os.path.dirname(path), "state.json")
            )  # the peer's atomic write ends
        real(path)

    def write(tmp):
        for name in (".tmpA", "weights.bin"):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(name)

    monkeypatch.setattr(checkpoints, "fsync_path", peer_renames_first)
    final = checkpoints.write_folder(str(tmp_path), "checkpoint-3", write)
    assert sorted(os.listdir(final)) == ["state.json", "weights.bin"]
