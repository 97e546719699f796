"""The English corpus and tokenizer bundled with plait under ``examples/data/``.

- ``web_bible.txt.xz``: the World English Bible (public domain), 4,996,554 bytes of UTF-8 prose,
  one paragraph, poetry line or heading per line; xz-compressed to about 1.1 MB. Provenance and
  the rebuild recipe are in ``examples/data/README.md``.
- ``tokenizer.json``: byte-level BPE, 8192 entries, trained on that corpus with Hugging Face
  ``tokenizers``; special tokens ``[PAD]=0 [UNK]=1 [CLS]=2 [SEP]=3 [MASK]=4 <|endoftext|>=5``.

The directory is found next to the ``plait`` package (a source checkout or editable install). For
other installs pass ``data_dir`` explicitly. Decompressed and tokenized copies go to a cache
directory: ``cache_dir`` if given, else ``$PLAIT_CACHE`` or ``$XDG_CACHE_HOME/plait`` or
``~/.cache/plait``. Cache files are named by a content hash and written atomically (temporary
file, then rename), so concurrent ranks and interrupted runs never see a partial file.
"""

from __future__ import annotations

import hashlib
import lzma
import os
from pathlib import Path

CORPUS_FILE = "web_bible.txt.xz"
TOKENIZER_FILE = "tokenizer.json"


def bundled_data_dir(data_dir: str | os.PathLike | None = None) -> Path:
    """Directory holding the bundled corpus and tokenizer.

    Raises FileNotFoundError (naming the path tried and the fix) if the files are not there.
    """
    d = (
        Path(data_dir)
        if data_dir is not None
        else Path(__file__).resolve().parents[2] / "examples" / "data"
    )
    if not (d / CORPUS_FILE).is_file() or not (d / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(
            f"bundled data not found: expected {d / CORPUS_FILE} and {d / TOKENIZER_FILE}. plait looks "
            f"for examples/data/ next to the package, which exists in a source checkout or editable "
            f"install; otherwise pass data_dir= pointing at a copy of examples/data/"
        )
    return d


def cache_dir_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache directory (created if missing); see the module docstring for the lookup order."""
    if cache_dir is not None:
        d = Path(cache_dir)
    elif os.environ.get("PLAIT_CACHE"):
        d = Path(os.environ["PLAIT_CACHE"])
    else:
        d = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "plait"
    d.mkdir(parents=True, exist_ok=True)
    return d


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a per-process temporary file and an atomic rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def bundled_tokenizer_path(data_dir: str | os.PathLike | None = None) -> Path:
    """Path of the bundled ``tokenizer.json`` (vocabulary 8192). Raises FileNotFoundError if absent."""
    return bundled_data_dir(data_dir) / TOKENIZER_FILE


def bundled_corpus_path(
    cache_dir: str | os.PathLike | None = None, data_dir: str | os.PathLike | None = None
) -> Path:
    """Path of the decompressed bundled corpus (a UTF-8 ``.txt`` of about 5.0 MB).

    Decompresses ``web_bible.txt.xz`` into the cache directory on first use; later calls return
    the cached file. Raises FileNotFoundError if the bundled data is missing.
    """
    src = bundled_data_dir(data_dir) / CORPUS_FILE
    out = cache_dir_path(cache_dir) / f"web_bible-{file_sha256(src)[:16]}.txt"
    if not out.is_file():
        atomic_write_bytes(out, lzma.decompress(src.read_bytes()))
    return out


def load_bundled_text(
    cache_dir: str | os.PathLike | None = None, data_dir: str | os.PathLike | None = None
) -> str:
    """The bundled corpus as one string (about 4.94 million characters, ``\\n``-separated lines)."""
    return bundled_corpus_path(cache_dir, data_dir).read_text(encoding="utf-8")
