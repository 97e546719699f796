"""``index.json``: schema, naming conventions, model fingerprint, building and validating.

Schema (version 1; see FORMAT.md)::

    {"format": "plait-checkpoint", "version": 1, "tag": "step100", "saved_at": 1.7e9,
     "writers": 4, "checksum": "crc32", "model_fingerprint": "sha256:...",
     "files": {"rank00000.safetensors": {"bytes": 1234, "checksum": "crc32:89abcdef"},
               "meta.json": {...}},
     "tensors": {"layers.0.attn.q_proj.weight":
                   {"shape": [64, 64], "dtype": "bfloat16",
                    "slices": [{"file": "rank00000.safetensors", "key": "layers.0.attn.q_proj.weight",
                                "offsets": [0, 0], "lengths": [32, 64]}, ...]}}}
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

from plait.checkpoint.boxes import box_error, check_tiling
from plait.checkpoint.errors import CheckpointError, read_json
from plait.checkpoint.stfile import DTYPE_BY_NAME

FORMAT = "plait-checkpoint"
VERSION = 1
INDEX_FILE = "index.json"
META_FILE = "meta.json"
RANK_META_FILE = "rank_meta.json"
OPTIMIZER_PREFIX = "optimizer."


def optimizer_key(state: str, param: str) -> str:
    """Logical name of optimizer state ``state`` (e.g. ``exp_avg``) of parameter ``param``:
    ``optimizer.exp_avg.layers.3.attn.q_proj.weight``. fp32 master weights use ``state="master"``."""
    if "." in state:
        raise ValueError(f"optimizer state name {state!r} must not contain '.'")
    return f"{OPTIMIZER_PREFIX}{state}.{param}"


def split_optimizer_key(name: str) -> tuple[str, str] | None:
    """``(state, param)`` of an optimizer-state name, or None for a model weight."""
    if not name.startswith(OPTIMIZER_PREFIX):
        return None
    state, _, param = name[len(OPTIMIZER_PREFIX) :].partition(".")
    return state, param


def model_fingerprint(shapes: Mapping[str, Sequence[int]]) -> str:
    """``"sha256:<hex>"`` of the sorted (name, shape) pairs of the model weights in ``shapes``.

    Names starting with ``optimizer.`` are ignored, so the fingerprint depends only on the
    model's logical weights, never on dtype, layout or optimizer.
    """
    pairs = sorted(
        (n, [int(s) for s in shape])
        for n, shape in shapes.items()
        if not n.startswith(OPTIMIZER_PREFIX)
    )
    return "sha256:" + hashlib.sha256(json.dumps(pairs, separators=(",", ":")).encode()).hexdigest()


def build_index(
    tag: str, slices: list[dict], files: dict[str, dict], writers: int, saved_at: float
) -> dict:
    """Assemble and validate the index from every rank's slice descriptors.

    ``slices``: dicts ``{name, dtype, shape, offsets, lengths, file, key, rank}``. Raises
    ``CheckpointError`` naming the tensor and ranks when ranks disagree on a tensor's global
    shape or dtype, or its slices do not tile it exactly (overlap: a replicated tensor passed
    by two ranks; gap: a slice nobody passed).
    """
    tensors: dict[str, dict] = {}
    owners: dict[str, list[int]] = {}
    for s in slices:
        entry = tensors.setdefault(
            s["name"], {"shape": list(s["shape"]), "dtype": s["dtype"], "slices": []}
        )
        if entry["shape"] != list(s["shape"]) or entry["dtype"] != s["dtype"]:
            first = owners[s["name"]][0]
            raise CheckpointError(
                f"tensor {s['name']!r}: rank {first} saves global shape {entry['shape']} dtype "
                f"{entry['dtype']}, rank {s['rank']} saves global shape {list(s['shape'])} dtype {s['dtype']}"
            )
        entry["slices"].append({k: s[k] for k in ("file", "key", "offsets", "lengths")})
        owners.setdefault(s["name"], []).append(s["rank"])
    for name, entry in tensors.items():
        ranks = owners[name]
        check_tiling(
            name,
            entry["shape"],
            [(sl["offsets"], sl["lengths"]) for sl in entry["slices"]],
            describe=lambda i, ranks=ranks: f"the slice from rank {ranks[i]}",
        )
    shapes = {n: e["shape"] for n, e in tensors.items()}
    index = {
        "format": FORMAT,
        "version": VERSION,
        "tag": tag,
        "saved_at": saved_at,
        "writers": writers,
        "checksum": "crc32",
        "model_fingerprint": model_fingerprint(shapes),
        "files": files,
        "tensors": dict(sorted(tensors.items())),
    }
    return {**index, "index_checksum": index_checksum(index)}


def index_checksum(index: dict) -> str:
    """``"sha256:<hex>"`` of the index's canonical JSON (sorted keys, no spaces) without this field: the
    index's own checksum, so a damaged or hand-edited ``index.json`` is refused like a damaged file."""
    body = {k: v for k, v in index.items() if k != "index_checksum"}
    return (
        "sha256:"
        + hashlib.sha256(
            json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
    )


def _fail(path: str, msg: str):
    raise CheckpointError(f"checkpoint index {path}: {msg}")


def _int_list(value) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def load_index(path: str) -> dict:
    """Read and validate ``index.json`` at ``path``; no tensor file is opened.

    Checks: valid JSON, format and version, every file entry has int bytes and a checksum and
    a plain file name, every tensor has a known dtype, in-bounds slices in listed files that
    tile it exactly, and the recorded fingerprint matches the tensors.

    Raises:
        CheckpointError: naming ``path`` and the offending file or tensor.
    """
    try:
        index = read_json(path, "checkpoint index")
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint index {path} is missing (not a checkpoint, or a save that did not finish)"
        ) from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        _fail(
            path,
            f"format is {index.get('format') if isinstance(index, dict) else None!r}, "
            f"expected {FORMAT!r}",
        )
    if index.get("version") != VERSION:
        _fail(
            path, f"version {index.get('version')!r} is not supported (this reader knows {VERSION})"
        )
    files, tensors = index.get("files"), index.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        _fail(path, "'files' and 'tensors' must be JSON objects")
    _check_files(path, files)
    for name, entry in tensors.items():
        _check_tensor(path, name, entry, files)
    _check_sums(path, index, tensors)
    return index


def _check_files(path: str, files: dict) -> None:
    """Every file entry: a plain name, integer ``bytes`` and a string ``checksum``."""
    for fname, info in files.items():
        if "/" in fname or "\\" in fname or fname.startswith("."):
            _fail(path, f"file name {fname!r} must be a plain name inside the checkpoint directory")
        if (
            not isinstance(info, dict)
            or type(info.get("bytes")) is not int
            or not isinstance(info.get("checksum"), str)
        ):
            _fail(path, f"file {fname!r} needs integer 'bytes' and string 'checksum', got {info!r}")


def _check_tensor(path: str, name: str, entry, files: dict) -> None:
    """Tensor ``name``: its shape, a known dtype, in-bounds slices in listed ``files`` that tile it exactly."""
    if (
        not isinstance(entry, dict)
        or not _int_list(entry.get("shape"))
        or not isinstance(entry.get("slices"), list)
    ):
        _fail(path, f"tensor {name!r} needs 'shape' (list of int) and 'slices' (list)")
    if entry.get("dtype") not in DTYPE_BY_NAME:
        _fail(path, f"tensor {name!r} has unknown dtype {entry.get('dtype')!r}")
    for i, sl in enumerate(entry["slices"]):
        if (
            not isinstance(sl, dict)
            or sl.get("file") not in files
            or not isinstance(sl.get("key"), str)
        ):
            _fail(path, f"tensor {name!r} slice {i} must name a listed file and a key, got {sl!r}")
        err = box_error(
            entry["shape"],
            sl.get("offsets") if _int_list(sl.get("offsets")) else [None],
            sl.get("lengths") if _int_list(sl.get("lengths")) else [None],
        )
        if err:
            _fail(path, f"tensor {name!r} slice {i} ({sl['file']}): {err}")
    try:
        check_tiling(
            name,
            entry["shape"],
            [(s["offsets"], s["lengths"]) for s in entry["slices"]],
            describe=lambda i, sl=entry["slices"]: f"slice {i} ({sl[i]['file']}:{sl[i]['key']})",
        )
    except CheckpointError as e:
        _fail(path, str(e))


def _check_sums(path: str, index: dict, tensors: dict) -> None:
    """The index's own checksum (when recorded) and the model fingerprint of its tensors."""
    own = index.get("index_checksum")  # absent in checkpoints written before it was added
    if own is not None and own != index_checksum(index):
        _fail(
            path,
            f"its own checksum {own!r} does not match its contents ({index_checksum(index)}): the file was "
            "damaged or edited; restore it or load another checkpoint",
        )
    expected = model_fingerprint({n: e["shape"] for n, e in tensors.items()})
    if index.get("model_fingerprint") != expected:
        _fail(
            path,
            f"model fingerprint {index.get('model_fingerprint')!r} does not match its tensors "
            f"({expected}); the index was edited or mixed with another model's",
        )


def dumps_index(index: dict) -> bytes:
    """UTF-8 JSON of ``index``, one file and one tensor per line (readable, and compact for
    thousands of slices)."""

    def block(key: str, mapping: dict) -> str:
        rows = [
            f"  {json.dumps(k)}: {json.dumps(v, separators=(', ', ': '))}"
            for k, v in mapping.items()
        ]
        return f" {json.dumps(key)}: {{\n" + ",\n".join(rows) + "\n }"

    head = [
        f" {json.dumps(k)}: {json.dumps(v)}"
        for k, v in index.items()
        if k not in ("files", "tensors")
    ]
    body = head + [block("files", index["files"]), block("tensors", index["tensors"])]
    return ("{\n" + ",\n".join(body) + "\n}\n").encode("utf-8")
