"""The one exception type of the checkpoint package, and its reads of small files from elsewhere."""

from __future__ import annotations

from plait import untrusted


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, inconsistent, or does not fit the model or request.

    The message names the checkpoint directory or file, the tensor, and the numbers involved.
    """


def read_json(path: str, what: str = "checkpoint file"):
    """The parsed JSON file at ``path``: the one path every checkpoint JSON is read through
    (``plait.untrusted.read_json``: a regular file of at most ``SMALL_FILE_CAP`` bytes).

    Raises:
        FileNotFoundError: no such file (callers that treat it specially catch it).
        CheckpointError: not a regular file, too large, or not UTF-8 JSON, naming ``what``, ``path`` and why.
    """
    return untrusted.read_json(path, what, error=CheckpointError)


def read_text(path: str, what: str = "checkpoint file") -> str:
    """The UTF-8 text of ``path``, stripped (``latest``); errors as in ``read_json``."""
    return untrusted.read_text(path, what, error=CheckpointError)


def inside(folder: str, name: str, what: str = "checkpoint file") -> str:
    """``folder/name``, refused with ``CheckpointError`` unless it resolves inside ``folder``
    (``plait.untrusted.inside``)."""
    return untrusted.inside(folder, name, what, error=CheckpointError)
