"""Checkpoint metadata is plain JSON: validation with key paths, and tensors (RNG states) as JSON.

``meta.json`` holds whatever dict the caller passes (step counters, config, mesh, RNG states,
scheduler, loss scaler, data position, ``client_state``). Nothing is pickled: a value that
JSON cannot represent exactly is rejected with its key path, e.g.
``meta['client_state']['sampler'][2]: numpy.int64 is not JSON``.
"""

from __future__ import annotations

import base64
import json

import torch

from plait.checkpoint.errors import CheckpointError

_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )
}


def json_error(value, path: str = "meta") -> str | None:
    """Why ``value`` does not round-trip through JSON (with its key path), or None if it does.

    Allowed: dict with str keys, list, tuple (read back as a list), str, int, float (NaN/inf
    are written as Python's json writes them), bool, None.
    """
    if value is None or isinstance(value, (str, bool, int, float)):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return (
                    f"{path}: key {key!r} is a {type(key).__module__}.{type(key).__qualname__}; "
                    "JSON object keys must be str"
                )
            err = json_error(item, f"{path}[{key!r}]")
            if err:
                return err
        return None
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            err = json_error(item, f"{path}[{i}]")
            if err:
                return err
        return None
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    hint = (
        " (use plait.checkpoint.tensor_to_json for tensors)"
        if isinstance(value, torch.Tensor)
        else ""
    )
    return f"{path}: {kind} is not JSON-serialisable{hint}"


def check_json(value, path: str = "meta") -> None:
    """Raise ``CheckpointError`` naming the key path of the first non-JSON value in ``value``."""
    err = json_error(value, path)
    if err:
        raise CheckpointError(f"cannot save checkpoint metadata: {err}")


def tensor_to_json(t: torch.Tensor) -> dict:
    """A small CPU tensor (e.g. ``torch.get_rng_state()``, uint8 ``[5056]``) as JSON:
    ``{"dtype": "uint8", "shape": [...], "base64": "..."}`` (raw little-endian bytes)."""
    name = str(t.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise CheckpointError(
            f"tensor_to_json: dtype {t.dtype} is not supported ({sorted(_DTYPES)})"
        )
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return {"dtype": name, "shape": list(t.shape), "base64": base64.b64encode(raw).decode("ascii")}


def tensor_from_json(obj: dict) -> torch.Tensor:
    """Inverse of ``tensor_to_json``: a new CPU tensor with the recorded dtype and shape."""
    dtype = _DTYPES[obj["dtype"]]
    raw = bytearray(base64.b64decode(obj["base64"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(obj["shape"]).clone()


def dumps(obj) -> bytes:
    """UTF-8 JSON of already-checked metadata."""
    return (json.dumps(obj, indent=1) + "\n").encode("utf-8")
