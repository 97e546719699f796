"""Streaming safetensors writer that checksums as it writes, and the dtype names of the format.

The file is standard safetensors (read back with ``safetensors.safe_open``): an 8-byte
little-endian header length, a JSON header ``{key: {"dtype", "shape", "data_offsets"}}``
padded with spaces to a multiple of 8 bytes, then the raw little-endian tensor bytes in
header order. Writing it here, one tensor at a time, avoids the whole-file copy in memory
that ``safetensors.torch.save_file`` makes, and gives the CRC-32 without reading the file back.
"""

from __future__ import annotations

import json
import os
import struct
import sys

import torch

from plait.checkpoint.integrity import CHUNK_BYTES, Crc32

ST_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if hasattr(torch, _name):
        ST_DTYPES[getattr(torch, _name)] = _code

# Index dtype strings are torch names without the "torch." prefix, e.g. "bfloat16".
DTYPE_BY_NAME = {str(d).removeprefix("torch."): d for d in ST_DTYPES}


def dtype_name(dtype: torch.dtype) -> str:
    """The index's name for ``dtype`` (``"float32"``, ``"bfloat16"``, ...).

    Raises:
        ValueError: safetensors cannot store ``dtype``.
    """
    if dtype not in ST_DTYPES:
        raise ValueError(
            f"dtype {dtype} cannot be stored in safetensors (supported: {sorted(DTYPE_BY_NAME)})"
        )
    return str(dtype).removeprefix("torch.")


def write_safetensors(path: str, items: list[tuple[str, torch.Tensor]], after_tensor=None) -> dict:
    """Write ``items`` (key, tensor on any device) to ``path`` as safetensors and fsync it.

    ``after_tensor(i)``, if given, is called after tensor ``i`` is written (a test hook).
    Returns ``{"bytes": file size, "checksum": "crc32:%08x"}`` of the whole file.
    """
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        raise RuntimeError("plait checkpoints are written on little-endian hosts only")
    header, offset = {}, 0
    for key, t in items:
        nbytes = t.numel() * t.element_size()
        header[key] = {
            "dtype": ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    crc = Crc32()
    with open(path, "wb") as f:
        head = struct.pack("<Q", len(text)) + text
        f.write(head)
        crc.update(head)
        for i, (_, t) in enumerate(items):
            flat = t.detach().reshape(-1)
            step = max(1, CHUNK_BYTES // max(1, t.element_size()))
            for start in range(0, flat.numel(), step):  # one chunk at a time: bounded host copies
                part = flat[start : start + step].to("cpu").contiguous().view(torch.uint8).numpy()
                data = memoryview(part)
                f.write(data)
                crc.update(data)
            if after_tensor is not None:
                f.flush()
                after_tensor(i)
        f.flush()
        os.fsync(f.fileno())
        size = f.tell()
    return {"bytes": size, "checksum": crc.value}
