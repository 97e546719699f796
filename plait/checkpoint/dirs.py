"""The checkpoint root directory: tags, ``latest``, atomic publish, pruning and crash leftovers.

Layout of ``root``::

    latest                      text file: the tag of the newest complete checkpoint
    <tag>/                      a complete checkpoint (index.json, meta.json, *.safetensors)
    .tmp-<tag>-<nonce>/         a save in progress, or left by a crash (removed by the next save)
    .old-<tag>-<nonce>/         the previous <tag> while it is being replaced by a save of the same tag
    .del-<tag>-<nonce>/         a checkpoint being deleted by pruning

Only rank 0 of a save changes the root. Publishing is ``rename(tmp, <tag>)``, fsync of the root,
then ``latest.tmp`` written, fsynced and ``os.replace``d onto ``latest``. A crash at any point
leaves ``latest`` naming a complete checkpoint (see ``resolve_tag``).
"""

from __future__ import annotations

import os
import re
import shutil

from plait.checkpoint.errors import CheckpointError, inside, read_json, read_text
from plait.checkpoint.index import INDEX_FILE
from plait.checkpoint.integrity import fsync_path

LATEST = "latest"
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+=-]*$")


def check_tag(tag: str) -> None:
    """Raise ``CheckpointError`` unless ``tag`` is a usable directory name (letters, digits, ``_.+=-``,
    not starting with ``.`` or ``-``, not ``latest``, at most 200 characters)."""
    if not isinstance(tag, str) or not _TAG.match(tag) or tag == LATEST or len(tag) > 200:
        raise CheckpointError(
            f"checkpoint tag {tag!r} is not allowed: use letters, digits and _.+=- "
            f"(not starting with '.' or '-', not {LATEST!r}), e.g. 'step1000'"
        )


def read_latest(root: str) -> str | None:
    """The tag ``<root>/latest`` names, or None if there is no ``latest`` file.

    Raises:
        CheckpointError: ``latest`` resolves outside ``root``, is not a regular file, is too large or not text.
    """
    what = "the latest-checkpoint pointer"
    try:
        return read_text(inside(root, LATEST, what), what)
    except FileNotFoundError:
        return None


def resolve_tag(root: str, tag: str | None) -> tuple[str, str]:
    """``(tag, directory)`` of the checkpoint to read: ``tag``, or the one ``latest`` names.

    If ``<root>/<tag>`` is absent but ``.old-<tag>-*`` exists, a save replacing ``<tag>`` crashed
    between its two renames and the old copy (complete) is returned.

    Raises:
        CheckpointError: no ``latest`` (when ``tag`` is None) or no such checkpoint.
    """
    if tag is None:
        tag = read_latest(root)
        if tag is None:
            raise CheckpointError(
                f"no checkpoint in {root}: {os.path.join(root, LATEST)} is missing "
                "(pass tag= to read a specific one)"
            )
    check_tag(tag)
    path = os.path.join(root, tag)
    if os.path.isdir(path):
        return tag, path
    prefix = f".old-{tag}-"
    olds = sorted(
        e
        for e in _entries(root)
        if e.startswith(prefix) and os.path.isfile(os.path.join(root, e, INDEX_FILE))
    )
    if olds:
        return tag, os.path.join(root, olds[-1])
    raise CheckpointError(
        f"checkpoint {path} does not exist"
        + (f" (available: {sorted(list_tags(root))})" if os.path.isdir(root) else "")
    )


def _entries(root: str) -> list[str]:
    try:
        return os.listdir(root)
    except FileNotFoundError:
        return []


def list_tags(root: str) -> dict[str, float]:
    """``{tag: saved_at}`` of the complete checkpoints in ``root`` (directories with a readable index)."""
    out = {}
    for e in _entries(root):
        if e.startswith(".") or e == LATEST:
            continue
        try:
            index = inside(os.path.join(root, e), INDEX_FILE, "checkpoint index")
            out[e] = float(read_json(index, "checkpoint index").get("saved_at", 0.0))
        except (OSError, ValueError, AttributeError, TypeError, CheckpointError):
            continue
    return out


def _write_latest(root: str, tag: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(tag + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    fsync_path(root)


def publish(
    root: str, tag: str, tmp_dir: str, nonce: str, pause=lambda phase: None, pointer: bool = True
) -> None:
    """Move the finished, fsynced ``tmp_dir`` to ``<root>/<tag>`` and point ``latest`` at it.

    An existing ``<tag>`` is first renamed to ``.old-<tag>-<nonce>`` and deleted only after
    ``latest`` is updated. ``pointer=False``: a root without ``latest`` (the Trainer's ``output_dir``,
    whose ``checkpoint-N`` folders are found by name). ``pause(phase)`` is a test hook called before each step.
    """
    final = os.path.join(root, tag)
    old = None
    if os.path.lexists(final):
        old = os.path.join(root, f".old-{tag}-{nonce}")
        pause("rename-old")
        os.rename(final, old)
    pause("rename")
    os.rename(tmp_dir, final)
    fsync_path(root)
    if pointer:
        pause("latest")
        _write_latest(root, tag)
    if old is not None:
        delete_dir(root, old)


def delete_dir(root: str, path: str) -> None:
    """Delete the folder ``path`` in ``root``; renamed to ``.del-<name>`` first, so that a crash midway never
    leaves a half-deleted folder under a checkpoint's name (``remove_leftovers`` finishes the job)."""
    name = os.path.basename(path)
    doomed = (
        path
        if name.startswith((".del-", ".tmp-"))
        else os.path.join(root, ".del-" + name.lstrip("."))
    )
    if doomed != path:
        os.rename(path, doomed)  # never leave a half-deleted directory under a checkpoint's name
    shutil.rmtree(doomed, ignore_errors=True)


def remove_leftovers(root: str, keep: str, complete=None) -> None:
    """Clean up after crashed saves: delete ``.tmp-*`` and ``.del-*`` dirs (except ``keep``);
    put a complete ``.old-<tag>-*`` back as ``<tag>`` when ``<tag>`` is missing, else delete it.
    ``complete(path) -> bool`` tells a complete checkpoint folder (default: it holds ``index.json``)."""
    complete = complete or (lambda path: os.path.isfile(os.path.join(path, INDEX_FILE)))
    for e in _entries(root):
        path = os.path.join(root, e)
        if path == keep:
            continue
        if e.startswith((".tmp-", ".del-")):
            shutil.rmtree(path, ignore_errors=True)
        elif e.startswith(".old-"):
            tag = e[len(".old-") :].rsplit("-", 1)[0]
            if os.path.lexists(os.path.join(root, tag)):
                shutil.rmtree(path, ignore_errors=True)
            elif complete(path):  # crash between publish's renames
                os.rename(path, os.path.join(root, tag))
                fsync_path(root)


def prune(root: str, keep_last: int) -> list[str]:
    """Delete all but the ``keep_last`` most recently saved checkpoints (by the index's
    ``saved_at``), never the one ``latest`` names. Returns the deleted tags."""
    if keep_last < 1:
        raise CheckpointError(f"keep_last must be >= 1, got {keep_last}")
    tags = list_tags(root)
    keep = set(sorted(tags, key=lambda t: (tags[t], t))[-keep_last:])
    latest = read_latest(root)
    if latest is not None:
        keep.add(latest)
    doomed = sorted(t for t in tags if t not in keep)
    for t in doomed:
        delete_dir(root, os.path.join(root, t))
    if doomed:
        fsync_path(root)
    return doomed
