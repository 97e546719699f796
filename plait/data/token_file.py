"""Tokenize text into a flat token file: ``<out>.bin`` (raw little-endian ids) plus ``<out>.bin.json``.

``build_token_file(sources, tokenizer_path, out)`` writes them (``bundled_token_file``: the bundled
corpus). The stream is every document of the sources in order, each followed by the end-of-sequence id::

    tokens = concat(tokenizer.encode(doc).ids + [eos_id] for doc in documents)

with no special tokens added (``<|endoftext|>`` in the text is plain text). ``doc_boundary`` is
``"blank_line"`` (default: runs of non-blank lines), ``"line"`` or ``"file"``; large files are encoded in
batches, cut only where byte-level pre-tokenization always splits, so the ids equal whole-document
encoding. Pre-tokenized sources (``.npy``, ``.bin`` with a sidecar) are copied after range checks. The
sidecar (``sidecar_path``, ``read_token_meta``) is written last, so a ``.bin`` without one is incomplete;
``load_tokens`` memory-maps a file. Rules and sidecar fields: ``docs/data.md``.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from plait.data.bundled import (
    atomic_write_bytes,
    bundled_corpus_path,
    bundled_tokenizer_path,
    cache_dir_path,
    file_sha256,
)

FORMAT = "plait-tokens"
VERSION = 1
DOC_BOUNDARIES = ("blank_line", "line", "file")
BATCH_CHARS = 1 << 20  # characters handed to one encode_batch call
COPY_CHUNK = 1 << 24  # tokens copied per chunk from pre-tokenized sources

PathLike = str | os.PathLike


def sidecar_path(path: PathLike) -> Path:
    """``<path>.json``: the metadata file next to a token file."""
    p = Path(path)
    return p.with_name(p.name + ".json")


def read_token_meta(path: PathLike) -> dict | None:
    """The sidecar metadata of a token file, or None if it has none."""
    side = sidecar_path(path)
    if not side.is_file():
        return None
    meta = json.loads(side.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"{side} is not a plait token sidecar (format={meta.get('format')!r}, want {FORMAT!r})"
        )
    return meta


def load_tokens(path: PathLike, dtype: np.dtype | str | None = None) -> np.ndarray:
    """Open a token file read-only as a 1-D memory-mapped array ``[num_tokens]`` (no copy).

    Accepts a plait ``.bin`` (dtype from its sidecar), a ``.npy`` of a 1-D integer array, or a raw
    ``.bin`` without sidecar when ``dtype`` is given. Raises FileNotFoundError if missing, ValueError
    if the dtype is unknown, not an integer type, or disagrees with the sidecar, or the array is not
    1-D.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"token file {p} does not exist")
    if p.suffix == ".npy":
        arr = np.load(p, mmap_mode="r")
    else:
        meta = read_token_meta(p)
        if meta is None and dtype is None:
            raise ValueError(
                f"{p} has no sidecar {sidecar_path(p).name}, so its dtype is unknown: pass dtype= "
                f"(e.g. numpy.uint16) or rebuild it with build_token_file"
            )
        if (
            meta is not None
            and dtype is not None
            and np.dtype(dtype).name != np.dtype(meta["dtype"]).name
        ):
            raise ValueError(
                f"{p}: dtype={np.dtype(dtype)} given but its sidecar says {meta['dtype']}"
            )
        dt = np.dtype(meta["dtype"] if meta is not None else dtype).newbyteorder(
            "<"
        )  # files are little-endian
        size = p.stat().st_size
        if size % dt.itemsize:
            raise ValueError(f"{p} is {size} bytes, not a multiple of {dt} ({dt.itemsize} bytes)")
        if meta is not None and size // dt.itemsize != meta["num_tokens"]:
            raise ValueError(
                f"{p} holds {size // dt.itemsize} tokens but its sidecar says {meta['num_tokens']}"
            )
        arr = np.memmap(p, dtype=dt, mode="r") if size else np.zeros(0, dtype=dt)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(
            f"{p} holds a {arr.ndim}-D {arr.dtype} array; token files are 1-D integer arrays"
        )
    return arr


def _can_cut(prev_line: str, next_line: str) -> bool:
    # Cutting "...c\n" | "d..." (c, d not whitespace) never changes byte-level pre-tokenization.
    return (
        len(prev_line) >= 2
        and prev_line[-1] == "\n"
        and not prev_line[-2].isspace()
        and not next_line[:1].isspace()
        and next_line != ""
    )


def iter_pieces(lines: Iterable[str], doc_boundary: str) -> Iterator[tuple[str, bool]]:
    """Yield ``(text, ends_document)`` pieces of ``lines`` (each keeping its ``\\n``); see module doc."""
    if doc_boundary == "line":
        for line in lines:
            if line.strip():
                yield line.removesuffix("\n"), True
        return
    buf: list[str] = []
    for line in lines:
        if doc_boundary == "blank_line" and not line.strip():
            if buf:
                buf[-1] = buf[-1].removesuffix("\n")
                yield "".join(buf), True
                buf = []
            continue
        if buf and _can_cut(buf[-1], line):
            yield "".join(buf), False
            buf = []
        buf.append(line)
    if buf:
        if doc_boundary == "blank_line" and buf[-1].endswith("\n"):
            buf[-1] = buf[-1][:-1]
        yield "".join(buf), True


class _Writer:
    """Appends id arrays to an open binary file, counting tokens and checking the id range."""

    def __init__(self, f, dtype: np.dtype, vocab_size: int):
        self.f, self.dtype, self.vocab_size, self.count = f, dtype, vocab_size, 0

    def write(self, ids: np.ndarray, where: str) -> None:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(
                f"{where}: token ids span [{int(ids.min())}, {int(ids.max())}] but the tokenizer has "
                f"vocab_size {self.vocab_size}; the tokens were made with another tokenizer"
            )
        self.f.write(np.ascontiguousarray(ids, dtype=self.dtype.newbyteorder("<")).tobytes())
        self.count += int(ids.size)


def _encode_text(
    tok, lines: Iterable[str], doc_boundary: str, eos_id: int, writer: _Writer, where: str
) -> int:
    batch: list[str] = []
    ends: list[bool] = []
    chars = 0
    docs = 0

    def flush() -> None:
        encs = tok.encode_batch(batch, add_special_tokens=False)
        parts = []
        for enc, end in zip(encs, ends):
            parts.append(np.asarray(enc.ids, dtype=np.int64))
            if end:
                parts.append(np.array([eos_id], dtype=np.int64))
        writer.write(np.concatenate(parts), where)
        batch.clear()
        ends.clear()

    for piece, end in iter_pieces(lines, doc_boundary):
        batch.append(piece)
        ends.append(end)
        docs += end
        chars += len(piece)
        if chars >= BATCH_CHARS:
            flush()
            chars = 0
    if batch:
        flush()
    return docs


def _copy_tokens(src: Path, writer: _Writer, tokenizer_sha: str) -> None:
    if src.suffix != ".npy":
        meta = read_token_meta(src)
        if meta is None:
            raise ValueError(
                f"pre-tokenized source {src} has no sidecar; only .npy or plait .bin files are accepted"
            )
        if meta["tokenizer_sha256"] != tokenizer_sha:
            raise ValueError(
                f"{src} was tokenized with tokenizer sha256 {meta['tokenizer_sha256'][:12]}…, not the "
                f"given one ({tokenizer_sha[:12]}…): rebuild it from text with this tokenizer"
            )
    arr = load_tokens(src)
    for start in range(0, arr.size, COPY_CHUNK):
        writer.write(np.asarray(arr[start : start + COPY_CHUNK]), str(src))


def _check_tokenizer(
    tok, tok_path: Path, dtype: np.dtype | str, eos_token: str
) -> tuple[int, np.dtype, int]:
    """Set ``tok`` to read special-token text as text and check it against ``dtype`` and ``eos_token``.

    Returns ``(vocab_size, dtype, eos_id)``; raises ValueError as :func:`build_token_file` documents.
    """
    tok.encode_special_tokens = True  # "<|endoftext|>" in text is text, not a control token
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    dt = np.dtype(dtype)
    if not np.issubdtype(dt, np.unsignedinteger) or vocab_size - 1 > np.iinfo(dt).max:
        raise ValueError(
            f"dtype {dt} cannot store ids up to {vocab_size - 1} (vocab_size {vocab_size}): use numpy.uint32"
        )
    eos_id = tok.token_to_id(eos_token)
    if eos_id is None:
        raise ValueError(f"eos_token {eos_token!r} is not in the vocabulary of {tok_path}")
    return vocab_size, dt, eos_id


def _write_tokens(
    out: Path,
    srcs: Sequence[Path],
    text: str | None,
    tok,
    doc_boundary: str,
    eos_id: int,
    dt: np.dtype,
    vocab_size: int,
    tok_sha: str,
) -> tuple[list[dict], int, int]:
    """Write every source, then ``text``, to ``out`` (via a temporary file renamed at the end).

    Returns the per-source records, the number of documents and the number of tokens written.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    records, num_docs = [], 0
    with open(tmp, "wb") as f:
        writer = _Writer(f, dt, vocab_size)
        for src in srcs:
            before = writer.count
            if src.suffix in (".npy", ".bin"):
                _copy_tokens(src, writer, tok_sha)
                rec = {"path": str(src), "kind": "tokens"}
            else:
                with open(src, encoding="utf-8", newline=None) as lines:
                    docs = _encode_text(tok, lines, doc_boundary, eos_id, writer, str(src))
                num_docs += docs
                rec = {
                    "path": str(src),
                    "kind": "text",
                    "sha256": file_sha256(src),
                    "num_documents": docs,
                }
            records.append({**rec, "num_tokens": writer.count - before})
        if text is not None:
            before = writer.count
            docs = _encode_text(
                tok, io.StringIO(text, newline=None), doc_boundary, eos_id, writer, "text="
            )
            num_docs += docs
            records.append(
                {
                    "path": None,
                    "kind": "text",
                    "num_documents": docs,
                    "num_tokens": writer.count - before,
                }
            )
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return records, num_docs, writer.count


def build_token_file(
    sources: PathLike | Sequence[PathLike] = (),
    tokenizer_path: PathLike | None = None,
    out_path: PathLike = "tokens.bin",
    *,
    text: str | None = None,
    dtype: np.dtype | str = np.uint16,
    doc_boundary: str = "blank_line",
    eos_token: str = "<|endoftext|>",
) -> Path:
    """Tokenize ``sources`` (then ``text``) into ``out_path`` (flat ids) and ``out_path + ".json"``.

    Args:
        sources: paths, in order: UTF-8 text files (any suffix but ``.npy``/``.bin``), or
            pre-tokenized ``.npy`` (1-D integers) / plait ``.bin`` files, copied verbatim.
        tokenizer_path: a Hugging Face ``tokenizer.json``; default the bundled one (8192 entries).
        out_path: the ``.bin`` to write; the sidecar goes to ``<out_path>.json``.
        text: in-memory text, tokenized after ``sources`` as one more source.
        dtype: unsigned storage type; uint16 holds vocabularies up to 65536 ids.
        doc_boundary: "blank_line", "line" or "file" (see module docstring).
        eos_token: the token appended after every document.

    Returns the ``out_path`` as a Path. Raises ValueError if no source is given, ``doc_boundary``
    is unknown, the vocabulary does not fit ``dtype``, ``eos_token`` is not in the vocabulary, or a
    pre-tokenized source has ids outside the vocabulary or another tokenizer's hash.
    """
    from tokenizers import Tokenizer

    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    srcs = [Path(s) for s in sources]
    if not srcs and text is None:
        raise ValueError("build_token_file needs at least one source path or text=")
    if doc_boundary not in DOC_BOUNDARIES:
        raise ValueError(f"doc_boundary={doc_boundary!r}; choose one of {DOC_BOUNDARIES}")
    tok_path = Path(tokenizer_path) if tokenizer_path is not None else bundled_tokenizer_path()
    tok = Tokenizer.from_file(str(tok_path))
    vocab_size, dt, eos_id = _check_tokenizer(tok, tok_path, dtype, eos_token)
    tok_sha = file_sha256(tok_path)

    out = Path(out_path)
    records, num_docs, num_tokens = _write_tokens(
        out, srcs, text, tok, doc_boundary, eos_id, dt, vocab_size, tok_sha
    )
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": dt.name,
        "num_tokens": num_tokens,
        "num_documents": num_docs,
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "tokenizer_sha256": tok_sha,
        "tokenizer_path": str(tok_path),
        "doc_boundary": doc_boundary,
        "sources": records,
    }
    atomic_write_bytes(sidecar_path(out), (json.dumps(meta, indent=1) + "\n").encode())
    return out


def bundled_token_file(cache_dir: PathLike | None = None, data_dir: PathLike | None = None) -> Path:
    """The whole bundled corpus tokenized with the bundled tokenizer (1,185,568 uint16 ids, one
    document ending in ``<|endoftext|>``), built into the cache directory on first use (about 1 s).
    """
    corpus = bundled_corpus_path(cache_dir, data_dir)
    tok = bundled_tokenizer_path(data_dir)
    out = cache_dir_path(cache_dir) / f"{corpus.stem}-tok{file_sha256(tok)[:12]}.bin"
    if read_token_meta(out) is None:
        build_token_file([corpus], tok, out, doc_boundary="blank_line")
    return out
