"""Files someone else wrote: confined to their folder, regular, and read with a bound.

Every loader of a checkpoint, Hugging Face folder or tokenizer from elsewhere reaches its files here, so a
name such as ``../x`` or a symlink leading out, a FIFO, or an endless or huge file is refused:

- ``inside(folder, name)``: the path of ``name`` in ``folder``, refused when it (symlinks resolved) leads out
  of the folder (a hub snapshot is confined to its repository's cache folder).
- ``file_size(path)``: the size of a regular file; a FIFO, device, socket or directory is refused.
- ``read_small`` / ``read_json`` / ``read_text``: a regular file of at most :data:`SMALL_FILE_CAP` bytes.
- ``hf_weight_files(folder)``: the tensor -> file map of a Hugging Face safetensors folder.

Each raises ``error``, the exception class its caller passes (default :class:`UntrustedFileError`; the
checkpoint package passes its ``CheckpointError``); a missing file stays ``FileNotFoundError``.
"""

from __future__ import annotations

import json
import os
import stat

#: The most bytes plait reads of a JSON or text file someone else wrote (checkpoint and Hugging Face index
#: files, config.json, meta.json, ``latest``, tokenizer files): 64 MiB, far above any real one.
SMALL_FILE_CAP = 64 << 20

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


class UntrustedFileError(ValueError):
    """A file from elsewhere is refused: outside its folder, not a regular file, too large, or not UTF-8 JSON."""


def _confinement(folder: str) -> str:
    """The folder files of ``folder`` may resolve into: ``folder`` itself (symlinks resolved), or for a hub
    snapshot ``<repo>/snapshots/<rev>`` the repository cache folder ``<repo>`` (its files link to blobs)."""
    base = os.path.realpath(folder)
    parent = os.path.dirname(base)
    if os.path.basename(parent) == "snapshots" and os.path.isdir(
        os.path.join(os.path.dirname(parent), "blobs")
    ):
        return os.path.dirname(parent)
    return base


def inside(
    folder: str | os.PathLike, name: str, what: str = "file", *, error=UntrustedFileError
) -> str:
    """``folder/name`` when ``name`` is a relative name that, symlinks resolved, stays inside ``folder``.

    Raises:
        error: ``name`` is absolute, holds ``..``, or resolves outside ``folder`` (names both paths).
    """
    folder = os.fspath(folder)
    if (
        not isinstance(name, str)
        or not name
        or "\0" in name
        or os.path.isabs(name)
        or ".." in name.replace("\\", "/").split("/")
    ):
        raise error(
            f"{what} {name!r} is not a plain relative name inside {folder}; refusing to open it "
            f"(a file from elsewhere may only name files in its own folder)"
        )
    path = os.path.join(folder, name)
    root, resolved = _confinement(folder), os.path.realpath(path)
    if os.path.commonpath([root, resolved]) != root:
        raise error(
            f"{what} {path} resolves to {resolved}, outside {root}; refusing to open it (a file from "
            f"elsewhere may only name files in its own folder)"
        )
    return path


def file_size(path: str, what: str = "file", *, error=UntrustedFileError) -> int:
    """Bytes of the regular file at ``path`` (symlinks followed).

    Raises:
        FileNotFoundError: no such file.
        error: it is a FIFO, a device, a socket or a directory (named).
    """
    info = os.stat(path)
    return _regular(info.st_mode, info.st_size, path, what, error)


def _regular(mode: int, size: int, path: str, what: str, error) -> int:
    for test, kind in _KINDS:
        if test(mode):
            raise error(f"{what} {path} is {kind}, not a regular file; refusing to read it")
    return size


def read_small(
    path: str, what: str = "file", cap: int = SMALL_FILE_CAP, *, error=UntrustedFileError
) -> bytes:
    """The bytes of the regular file ``path``, of at most ``cap`` bytes (checked before it is opened; at most
    ``cap + 1`` bytes are read, never blocking on a FIFO swapped in meanwhile).

    Raises:
        FileNotFoundError: no such file.
        error: not a regular file, or larger than ``cap`` (names the file, its size and the cap).
    """
    size = file_size(path, what, error=error)
    if size > cap:
        raise error(
            f"{what} {path} has {size} bytes, more than the {cap} ({cap / 2**20:g} MiB) plait reads of a "
            f"JSON or text file from elsewhere; refusing to read it (restore the file, or point to another "
            f"folder)"
        )
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        info = os.fstat(fd)
        _regular(info.st_mode, info.st_size, path, what, error)
        chunks, left = [], cap + 1
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 20))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > cap:
        raise error(f"{what} {path} grew past the {cap}-byte cap while it was read; refusing it")
    return data


def read_json(path: str, what: str = "file", *, error=UntrustedFileError):
    """The parsed JSON of ``path`` read by ``read_small``; bytes that are not UTF-8 JSON raise ``error``
    naming ``what``, ``path`` and the decoder's message."""
    return _parse(path, what, json.loads, error)


def read_text(path: str, what: str = "file", *, error=UntrustedFileError) -> str:
    """The UTF-8 text of ``path`` read by ``read_small``, stripped; errors as ``read_json``."""
    return _parse(path, what, str.strip, error)


def _parse(path: str, what: str, parse, error):
    raw = read_small(path, what, error=error)
    try:
        return parse(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(
            f"{what} {path} is damaged: not UTF-8 JSON text ({e}); restore it or point to another "
            "checkpoint"
        ) from None


def hf_weight_files(folder: str | os.PathLike, *, error=UntrustedFileError) -> dict[str, str]:
    """Tensor name -> path of the safetensors file holding it, for the Hugging Face folder ``folder``
    (``model.safetensors``, else the shards ``model.safetensors.index.json`` maps): every file inside the
    folder and regular, the index read with a bound.

    Raises:
        FileNotFoundError: neither file, or a shard the index lists, exists (named).
        error: the index is damaged or has no ``weight_map`` of names, or a file is outside or not regular.
    """
    folder = os.fspath(folder)
    if os.path.lexists(os.path.join(folder, HF_WEIGHTS)):
        path = inside(folder, HF_WEIGHTS, "Hugging Face weights", error=error)
        file_size(path, "Hugging Face weights", error=error)
        from safetensors import safe_open

        with safe_open(path, framework="pt") as handle:
            return dict.fromkeys(handle.keys(), path)  # noqa: SIM118 - safe_open is no dict
    if not os.path.lexists(os.path.join(folder, HF_INDEX)):
        raise FileNotFoundError(
            f"{folder} holds no .safetensors weights (neither {HF_WEIGHTS} nor {HF_INDEX}); "
            "pickled pytorch_model.bin files are not read: re-save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
    index = inside(folder, HF_INDEX, "Hugging Face weight index", error=error)
    parsed = read_json(index, "Hugging Face weight index", error=error)
    weight_map = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise error(f"{index} has no 'weight_map' object of tensor name -> file name")
    files = {}
    for fname in sorted(set(weight_map.values())):
        path = inside(folder, fname, f"{HF_INDEX} weight_map entry", error=error)
        try:
            file_size(path, "Hugging Face weights", error=error)
        except FileNotFoundError:
            raise FileNotFoundError(f"{index} lists {fname}, which is not in {folder}") from None
        files[fname] = path
    return {name: files[fname] for name, fname in weight_map.items()}
