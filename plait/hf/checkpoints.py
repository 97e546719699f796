"""The Trainer's ``output_dir/checkpoint-N/`` folders: written whole or not at all, and told apart on resume.

A save (``write_folder``) fills ``output_dir/.tmp-checkpoint-N-<nonce>/`` (every rank its engine shards and
RNG state, rank 0 the 16-bit model and last ``trainer_state.json``); only after every rank has written and
fsynced does rank 0 rename it to ``checkpoint-N`` (``plait.checkpoint.dirs.publish``). A crash leaves the
earlier checkpoints as they were and at most a ``.tmp-`` folder, which the next save removes.

``problem`` says why a ``checkpoint-N`` folder is incomplete or damaged. ``resume_folder`` resolves
``resume_from_checkpoint`` (True: the newest complete one, warning once per newer incomplete one; a path
naming an incomplete one is refused). ``rotate`` (``save_total_limit``) counts and deletes complete
checkpoints only. The save in order: ``docs/hf.md``.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterable

import torch.distributed as dist

from plait.checkpoint.dirs import delete_dir, publish, remove_leftovers, resolve_tag
from plait.checkpoint.errors import CheckpointError, read_json
from plait.checkpoint.index import INDEX_FILE
from plait.checkpoint.integrity import fsync_path

log = logging.getLogger("plait")

STATE_NAME = "trainer_state.json"
PREFIX = "checkpoint"
_NUMBERED = re.compile(
    r"^checkpoint-(\d+)$"
)  # transformers.trainer_utils' rule for a checkpoint folder


def numbered(output_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders in ``output_dir``, smallest ``N`` first (whether complete or not)."""
    try:
        names = os.listdir(output_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = sorted(
        (int(m.group(1)), name)
        for name in names
        if (m := _NUMBERED.match(name)) and os.path.isdir(os.path.join(output_dir, name))
    )
    return [os.path.join(output_dir, name) for _, name in found]


def problem(folder: str) -> str | None:
    """Why ``folder`` cannot be resumed from, in a few words naming the file; None for a complete checkpoint
    (a readable ``trainer_state.json`` with its ``global_step`` and an engine checkpoint with its index)."""
    if not os.path.isdir(folder):
        return "it is not a folder" if os.path.lexists(folder) else "it does not exist"
    state_file = os.path.join(folder, STATE_NAME)
    try:
        state = read_json(state_file, "trainer state")
    except FileNotFoundError:
        return f"it has no {STATE_NAME} (a save that did not finish)"
    except (OSError, CheckpointError) as e:
        return str(e)
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        return f"trainer state {state_file} is damaged: it holds no integer global_step"
    try:
        _, engine_dir = resolve_tag(folder, None)
    except CheckpointError as e:
        return f"its engine checkpoint is missing ({e})"
    if not os.path.isfile(os.path.join(engine_dir, INDEX_FILE)):
        return (
            f"its engine checkpoint {engine_dir} has no {INDEX_FILE} (a save that did not finish)"
        )
    return None


def last_complete(output_dir: str) -> tuple[str | None, list[tuple[str, str]]]:
    """``(newest complete checkpoint-N folder or None, [(folder, problem)] of the newer incomplete ones)``."""
    passed = []
    for folder in reversed(numbered(output_dir)):
        why = problem(folder)
        if why is None:
            return folder, passed
        passed.append((folder, why))
    return None, passed


def resume_folder(output_dir: str, resume, warn: bool) -> str:
    """The folder ``train(resume_from_checkpoint=resume)`` loads. ``resume=True``: the newest complete
    ``checkpoint-N`` in ``output_dir``, logging (when ``warn``) one warning line per newer incomplete folder
    passed over; a path: that folder, when complete.

    Raises:
        ValueError: ``resume=True`` and ``output_dir`` holds no complete checkpoint.
        CheckpointError: the path names an incomplete or damaged folder; the message names it, why, and the
            last complete checkpoint beside it.
    """
    if resume is True:
        found, passed = last_complete(output_dir)
        if found is None:
            seen = "".join(f"; {folder}: {why}" for folder, why in passed)
            raise ValueError(
                f"resume_from_checkpoint=True: no complete checkpoint-N folder in {output_dir}{seen}. Train "
                "without resume_from_checkpoint to start afresh"
            )
        for folder, why in passed if warn else ():
            log.warning(
                "resume_from_checkpoint=True: passing over %s, damaged or incomplete: %s; resuming from %s",
                folder,
                why,
                found,
            )
        return found
    folder = os.fspath(resume)
    why = problem(folder)
    if why is None:
        return folder
    last, _ = last_complete(os.path.dirname(os.path.normpath(folder)))
    instead = (
        f"Resume from {last} instead (resume_from_checkpoint={last!r}, or True for the newest complete one)"
        if last
        else "No complete checkpoint is beside it; train without resume_from_checkpoint to start afresh"
    )
    raise CheckpointError(
        f"cannot resume from {folder}: the checkpoint is damaged or incomplete: {why}. {instead}"
    )


def rotate(output_dir: str, limit: int | None, keep: Iterable[str | None]) -> list[str]:
    """``save_total_limit``: delete the oldest complete ``checkpoint-N`` folders until ``limit`` are left (as
    transformers' ``rotate_checkpoints``), never one in ``keep`` (the one just saved, the best model's) nor the
    newest complete one; incomplete folders are neither counted nor deleted. Returns the deleted folders."""
    if not limit or limit <= 0:
        return []
    complete = [f for f in numbered(output_dir) if problem(f) is None]
    wanted = {os.path.normpath(k) for k in (*keep, *complete[-1:]) if k}
    protected = [f for f in complete if os.path.normpath(f) in wanted]
    surplus = len(complete) - max(limit, len(protected))
    doomed = [f for f in complete if f not in protected][: max(surplus, 0)]
    for folder in doomed:
        log.info("save_total_limit=%d: deleting %s", limit, folder)
        delete_dir(output_dir, folder)
    if doomed:
        fsync_path(output_dir)
    return doomed


def write_folder(output_dir: str, name: str, write: Callable[[str], None]) -> str:
    """Write the checkpoint folder ``output_dir/name`` whole or not at all (see the module docstring);
    collective over the default process group. ``write(tmp)`` puts this rank's files into the temporary
    folder ``tmp`` (its collectives must be the same on every rank). Returns ``output_dir/name``.

    Raises:
        CheckpointError: on every rank, naming each rank's failure (a full disk, ...); nothing was published
            and the earlier checkpoints are as they were.
    """
    final, rank = os.path.join(output_dir, name), _rank()
    header = None
    if rank == 0:
        nonce = secrets.token_hex(6)
        tmp = os.path.join(output_dir, f".tmp-{name}-{nonce}")
        try:
            os.makedirs(output_dir, exist_ok=True)
            remove_leftovers(output_dir, keep=tmp, complete=lambda path: problem(path) is None)
            os.mkdir(tmp)
            header = (tmp, nonce, None)
        except OSError as e:
            header = (tmp, nonce, f"rank 0 cannot create {tmp}: {e}")
    tmp, nonce, error = _gather(header)[0]
    if error is not None:
        raise CheckpointError(f"saving checkpoint {final} failed: {error}")
    try:
        write(tmp)
        _fsync_files(tmp)
    except Exception as e:  # noqa: BLE001 - agreed on below, raised on every rank
        error = f"{type(e).__name__}: {e}"
    errors = _gather(error)  # every rank has written (or failed) before any rename
    status = None
    if rank == 0:
        try:
            if any(errors):
                raise CheckpointError(_by_rank(errors))
            fsync_path(tmp)
            publish(output_dir, name, tmp, nonce, pointer=False)
        except Exception as e:  # noqa: BLE001 - broadcast to every rank
            shutil.rmtree(tmp, ignore_errors=True)
            last, _ = last_complete(output_dir)
            status = (
                f"saving checkpoint {final} failed: {e if isinstance(e, CheckpointError) else repr(e)}. "
                f"Nothing was published; the newest complete checkpoint is still {last}"
            )
    status = _gather(status)[0]  # no rank goes on before the folder is in place
    if status is not None:
        raise CheckpointError(status)
    return final


def _fsync_files(folder: str) -> None:
    """fsync the plain files in ``folder`` (the engine's writer fsyncs its own subfolder). Another rank may be
    renaming its own temporary file there meanwhile (an atomic write): one that is gone is that rank's to sync."""
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            try:
                fsync_path(entry.path)
            except FileNotFoundError:
                continue


def on_rank0(fn: Callable[[], object]):
    """``fn()`` run on rank 0 alone (its logging appears once); its result, or the same ``ValueError`` /
    ``CheckpointError``, on every rank. Collective over the default process group."""
    outcome = None
    if _rank() == 0:
        try:
            outcome = (fn(), None)
        except (ValueError, CheckpointError) as e:
            outcome = (None, e)
    value, error = _gather(outcome)[0]
    if error is not None:
        raise error
    return value


def _by_rank(errors: list[str | None]) -> str:
    ranks: dict[str, list[str]] = {}
    for r, e in enumerate(errors):
        if e is not None:
            ranks.setdefault(e, []).append(str(r))
    return "; ".join(f"rank {', '.join(rs)}: {e}" for e, rs in ranks.items())


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _gather(obj) -> list:
    """Every rank's ``obj`` in rank order on every rank (a barrier too); ``[obj]`` without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
