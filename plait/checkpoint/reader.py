"""Validated, resharding reads: any N-d box of any logical tensor, from whatever slices were saved.

``CheckpointReader(root)`` checks the whole checkpoint before any tensor is read (index, file
presence, sizes, CRC-32s, safetensors headers against the index, slice tiling), then
``read(name, offsets, lengths)`` assembles the requested box from the stored slices that
overlap it, reading only those parts through ``safe_open(...).get_slice(key)[...]``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from plait.checkpoint.boxes import box_error, flat_range_boxes, intersect, volume
from plait.checkpoint.dirs import resolve_tag
from plait.checkpoint.errors import CheckpointError, inside, read_json
from plait.checkpoint.index import (
    INDEX_FILE,
    META_FILE,
    OPTIMIZER_PREFIX,
    RANK_META_FILE,
    load_index,
)
from plait.checkpoint.integrity import verify_file
from plait.checkpoint.stfile import DTYPE_BY_NAME, ST_DTYPES

VERIFY_MODES = ("full", "lazy", "size")


@dataclass
class ModelCheck:
    """Outcome of ``check_model(strict=False)``: model-weight names only in the model (``missing``)
    or only in the checkpoint (``unexpected``)."""

    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


class CheckpointReader:
    """Read-only view of one checkpoint directory.

    Args:
        root: the checkpoint root (holding ``latest`` and the tag directories).
        tag: checkpoint to open; None reads the one ``<root>/latest`` names.
        verify: ``"full"`` (default) checks sizes and CRC-32s of every file and every
            safetensors header now; ``"lazy"`` checks sizes now and each file's CRC-32 and
            header the first time it is read from; ``"size"`` checks sizes only.
        model: if given, ``check_model(model, strict)`` runs before the constructor returns.

    Raises:
        CheckpointError: no such checkpoint; index missing, unparsable or inconsistent; a file
            missing, of another size, or corrupted (message names the file); a file that resolves
            outside the checkpoint folder or is not a regular file; header and index disagree; model
            mismatch.
    """

    def __init__(
        self,
        root: str,
        tag: str | None = None,
        *,
        verify: str = "full",
        model: str | Mapping[str, Sequence[int]] | None = None,
        strict: bool = True,
    ):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.root = os.fspath(root)
        self.tag, self.path = resolve_tag(self.root, tag)
        self.index = load_index(self._file(INDEX_FILE))
        self._tensors = self.index["tensors"]
        self._handles: dict[str, object] = {}
        self._verified: set[str] = set()
        self._by_file: dict[str, list] | None = None
        self._lazy = verify == "lazy"
        for fname, info in self.index["files"].items():
            verify_file(
                self._file(fname), info["bytes"], info["checksum"] if verify == "full" else None
            )
        if verify == "full":
            for fname in self.index["files"]:
                self._check_header(fname)
        self.meta = self._json(META_FILE, {})
        self._rank_meta = self._json(RANK_META_FILE, None)
        if model is not None:
            self.check_model(model, strict=strict)

    # ----------------------------------------------------------------------------- files
    def _file(self, fname: str) -> str:
        """The path of ``fname`` in the checkpoint, refused unless it resolves inside the checkpoint folder."""
        return inside(self.path, fname)

    def _json(self, fname: str, default):
        if fname not in self.index["files"]:
            return default
        if self._lazy:
            info = self.index["files"][fname]
            verify_file(self._file(fname), info["bytes"], info["checksum"])
        return read_json(self._file(fname))

    def _slices_in(self, fname: str) -> list:
        if self._by_file is None:
            self._by_file = {}
            for name, entry in self._tensors.items():
                for sl in entry["slices"]:
                    self._by_file.setdefault(sl["file"], []).append((name, entry, sl))
        return self._by_file.get(fname, [])

    def _check_header(self, fname: str) -> None:
        """Every slice the index places in ``fname`` exists there with its shape and dtype."""
        if not fname.endswith(".safetensors"):
            return
        path = self._file(fname)
        handle = self._open(fname, check=False)
        keys = set(handle.keys())
        for name, entry, sl in self._slices_in(fname):
            if sl["key"] not in keys:
                raise CheckpointError(
                    f"checkpoint file {path} has no key {sl['key']!r} "
                    f"(index slice of tensor {name!r})"
                )
            part = handle.get_slice(sl["key"])
            shape, st_dtype = list(part.get_shape()), part.get_dtype()
            want = ST_DTYPES[DTYPE_BY_NAME[entry["dtype"]]]
            if shape != sl["lengths"] or st_dtype != want:
                raise CheckpointError(
                    f"checkpoint file {path} key {sl['key']!r}: shape {shape} dtype "
                    f"{st_dtype}, the index says tensor {name!r} slice has shape "
                    f"{sl['lengths']} dtype {want}"
                )
        self._verified.add(fname)

    def _open(self, fname: str, check: bool = True):
        if check and self._lazy and fname not in self._verified:
            info = self.index["files"][fname]
            verify_file(self._file(fname), info["bytes"], info["checksum"])
            self._check_header(fname)
        if fname not in self._handles:
            try:
                self._handles[fname] = safe_open(self._file(fname), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - safetensors raises several types
                raise CheckpointError(
                    f"checkpoint file {self._file(fname)} is not a readable safetensors file ({e})"
                ) from None
        return self._handles[fname]

    def close(self) -> None:
        """Drop the open file handles (reads reopen them)."""
        self._handles.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------------------------- queries
    def names(self, prefix: str = "") -> list[str]:
        """Sorted logical names starting with ``prefix``."""
        return sorted(n for n in self._tensors if n.startswith(prefix))

    def _entry(self, name: str) -> dict:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(
                f"checkpoint {self.path} has no tensor {name!r} ({len(self._tensors)} tensors)"
            ) from None

    def shape(self, name: str) -> tuple[int, ...]:
        """Global (logical) shape of ``name``."""
        return tuple(self._entry(name)["shape"])

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of ``name``."""
        return DTYPE_BY_NAME[self._entry(name)["dtype"]]

    @property
    def fingerprint(self) -> str:
        return self.index["model_fingerprint"]

    def rank_meta(self) -> list | None:
        """The per-rank JSON values passed as ``rank_meta`` at save (group-rank order), or None."""
        return self._rank_meta

    def check_model(
        self, model: str | Mapping[str, Sequence[int]], strict: bool = True
    ) -> ModelCheck:
        """Check that this checkpoint's model weights fit ``model``.

        ``model`` is a fingerprint (``model_fingerprint``) or ``{name: logical shape}``; names
        under ``optimizer.`` are ignored on both sides.

        Raises:
            CheckpointError: fingerprint mismatch; a shape mismatch (names the tensor and both
                shapes); with ``strict``, missing or unexpected model weights (listed).
        """
        if isinstance(model, str):
            if model != self.fingerprint:
                raise CheckpointError(
                    f"checkpoint {self.path} is of another model: fingerprint "
                    f"{self.fingerprint}, expected {model}"
                )
            return ModelCheck()
        want = {
            n: tuple(int(s) for s in shp)
            for n, shp in model.items()
            if not n.startswith(OPTIMIZER_PREFIX)
        }
        have = {
            n: tuple(e["shape"])
            for n, e in self._tensors.items()
            if not n.startswith(OPTIMIZER_PREFIX)
        }
        for n in sorted(set(want) & set(have)):
            if want[n] != have[n]:
                raise CheckpointError(
                    f"checkpoint {self.path}: tensor {n!r} has shape {list(have[n])}, "
                    f"the model expects {list(want[n])}"
                )
        report = ModelCheck(sorted(set(want) - set(have)), sorted(set(have) - set(want)))
        if strict and (report.missing or report.unexpected):
            raise CheckpointError(
                f"checkpoint {self.path} does not match the model: missing "
                f"{_few(report.missing)}, unexpected {_few(report.unexpected)}"
            )
        return report

    # ----------------------------------------------------------------------------- reads
    def read(
        self,
        name: str,
        offsets: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        dtype: torch.dtype | None = None,
        device=None,
    ) -> torch.Tensor:
        """The box ``tensor[o0:o0+l0, ...]`` of logical tensor ``name``, shape ``lengths``.

        ``offsets``/``lengths`` default to the whole tensor. Only the stored slices that overlap
        the box are touched, and of each only the overlapping part is read. ``dtype`` converts
        (default: stored dtype); ``device`` places the result (default: CPU).

        Raises:
            CheckpointError: unknown name, box outside the global shape, or a file fails its
                lazy verification.
        """
        entry = self._entry(name)
        shape = tuple(entry["shape"])
        offsets = tuple(int(o) for o in (offsets if offsets is not None else (0,) * len(shape)))
        lengths = tuple(int(n) for n in (lengths if lengths is not None else shape))
        err = box_error(shape, offsets, lengths)
        if err:
            raise CheckpointError(f"read of tensor {name!r} from {self.path}: {err}")
        out = torch.empty(lengths, dtype=dtype or DTYPE_BY_NAME[entry["dtype"]], device=device)
        if volume(lengths) == 0:
            return out
        want = (offsets, lengths)
        for sl in entry["slices"]:
            common = intersect(want, (tuple(sl["offsets"]), tuple(sl["lengths"])))
            if common is None:
                continue
            src = tuple(
                slice(c - s, c - s + n) for c, s, n in zip(common[0], sl["offsets"], common[1])
            )
            dst = tuple(slice(c - o, c - o + n) for c, o, n in zip(common[0], offsets, common[1]))
            part = self._open(sl["file"]).get_slice(sl["key"])[src]
            out[dst].copy_(part)
        return out

    def read_flat(
        self, name: str, start: int, stop: int, dtype: torch.dtype | None = None, device=None
    ) -> torch.Tensor:
        """Elements ``[start, stop)`` of the row-major flattened tensor ``name``, shape ``[stop - start]``
        (a ZeRO partition of one parameter)."""
        shape = self.shape(name)
        try:
            boxes = flat_range_boxes(shape, start, stop)
        except ValueError as e:
            raise CheckpointError(f"read_flat of tensor {name!r} from {self.path}: {e}") from None
        parts = [self.read(name, o, n, dtype, device).reshape(-1) for o, n in boxes]
        if not parts:
            return torch.empty(0, dtype=dtype or self.dtype(name), device=device)
        return torch.cat(parts)


def _few(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    more = f", ... ({len(names)} in all)" if len(names) > limit else ""
    return f"[{shown}{more}]"
