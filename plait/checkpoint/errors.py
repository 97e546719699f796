"""The one exception type of the checkpoint package."""
from __future__ import annotations

import json


class CheckpointError(RuntimeError):
    """A checkpoint is missing, damaged, inconsistent, or does not fit the model or request.

    The message names the checkpoint directory or file, the tensor, and the numbers involved.
    """


def read_json(path: str, what: str = "checkpoint file"):
    """The parsed JSON file at ``path``: the one path every checkpoint JSON is read through.

    Raises:
        FileNotFoundError: no such file (callers that treat it specially catch it).
        CheckpointError: the bytes are not UTF-8 or not JSON, naming ``what``, ``path`` and the error.
    """
    return _parse(path, what, json.loads)


def read_text(path: str, what: str = "checkpoint file") -> str:
    """The UTF-8 text of ``path``, stripped (``latest``); decode errors as in ``read_json``."""
    return _parse(path, what, str.strip)


def _parse(path: str, what: str, parse):
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return parse(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{what} {path} is damaged: not UTF-8 JSON text ({e}); restore it or point to another "
                              "checkpoint") from None
