"""Extract plain English prose from Debian's ``sword-text-web`` package (World English Bible).

Reproduces ``examples/data/web_bible.txt.xz`` byte for byte::

    apt-get download sword-text-web
    dpkg -x sword-text-web_*.deb /tmp/web
    python examples/data/extract_web.py /tmp/web/usr/share/sword/modules/texts/ztext/engWEB2015eb

Format of the SWORD zText module (``BlockType=BOOK``, ``CompressType=ZIP``):

- ``{ot,nt}.bzs``: one 12-byte entry per compressed block, three little-endian uint32
  ``(offset into .bzz, compressed size, uncompressed size)``.
- ``{ot,nt}.bzz``: the zlib streams, one per book; decompressed each is OSIS XML (UTF-8).

Cleaning: ``<note>`` elements are dropped with their content (footnotes, cross references); every
other tag is dropped and its text kept; titles, paragraphs, poetry lines, list items and chapter
starts become line breaks; entities are unescaped; whitespace within a line collapses to one space;
empty lines are dropped. The result is one paragraph, poetry line or heading per line, in canonical
book order (Old Testament with Deuterocanon, then New Testament). Standard library only.
"""

from __future__ import annotations

import argparse
import html
import lzma
import re
import struct
import sys
import zlib
from pathlib import Path

BLOCK_ENTRY = struct.Struct("<III")  # offset, compressed size, uncompressed size (bytes)
NOTE = re.compile(r"<note\b[^>]*>.*?</note>", re.DOTALL)
# Tags whose boundaries separate lines of prose: headings, paragraphs, poetry lines, line breaks,
# list items and chapter starts.
LINE_BREAK_TAG = re.compile(
    r"</?title\b[^>]*>|<div\b[^>]*type=\"(?:x-p|book|introduction|front|glossary)\"[^>]*>"
    r"|<l\b[^>]*>|</l>|<lg\b[^>]*>|<lb\b[^>]*>|</?item\b[^>]*>|</?list\b[^>]*>|<chapter\b[^>]*>"
)
ANY_TAG = re.compile(r"<[^>]*>")
NOTE_MARK = "\x00"
CLOSING = ".,;:!?”’)]"
# Where a note was, between two non-space characters on one line (the next one not consumed).
NOTE_GAP = re.compile(f"(\\S)[^\\S\n]*{NOTE_MARK}(?:[^\\S\n]*{NOTE_MARK})*[^\\S\n]*(?=(\\S))")


def read_blocks(module_dir: Path, testament: str) -> list[str]:
    """Return the decompressed OSIS XML of every block of ``testament`` ("ot" or "nt"), in order.

    Raises ValueError if a block's decompressed length differs from the size in the index.
    """
    index = (module_dir / f"{testament}.bzs").read_bytes()
    data = (module_dir / f"{testament}.bzz").read_bytes()
    if len(index) % BLOCK_ENTRY.size:
        raise ValueError(
            f"{testament}.bzs is {len(index)} bytes, not a multiple of {BLOCK_ENTRY.size}"
        )
    blocks = []
    for offset, size, usize in BLOCK_ENTRY.iter_unpack(index):
        raw = zlib.decompress(data[offset : offset + size])
        if len(raw) != usize:
            raise ValueError(f"{testament} block at {offset}: {len(raw)} bytes, index says {usize}")
        blocks.append(raw.decode("utf-8"))
    return blocks


def _join_note_gap(match: re.Match) -> str:
    # A removed note leaves a word boundary ("God<note/>created" -> "God created"), but no space
    # before closing punctuation ("coins <note/> ?" -> "coins?").
    return match.group(1) + ("" if match.group(2) in CLOSING else " ")


def osis_to_text(xml: str) -> str:
    """Convert OSIS XML to plain text lines (see the module docstring for the rules)."""
    text = NOTE.sub(NOTE_MARK, xml)
    text = LINE_BREAK_TAG.sub("\n", text)
    text = ANY_TAG.sub("", text)
    text = NOTE_GAP.sub(_join_note_gap, text)
    text = text.replace(NOTE_MARK, "")
    text = html.unescape(text)
    lines = (" ".join(line.split()) for line in text.split("\n"))
    return "\n".join(line for line in lines if line)


def extract(module_dir: Path) -> str:
    """Plain text of the whole module: Old Testament then New Testament, newline-terminated."""
    xml = "".join(block for t in ("ot", "nt") for block in read_blocks(module_dir, t))
    return osis_to_text(xml) + "\n"


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("module_dir", type=Path, help="…/modules/texts/ztext/engWEB2015eb")
    parser.add_argument("--out", type=Path, default=here / "web_bible.txt.xz")
    args = parser.parse_args(argv)
    text = extract(args.module_dir)
    data = text.encode("utf-8")
    # Fixed preset and check so the .xz is reproducible byte for byte.
    packed = lzma.compress(
        data, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME
    )
    args.out.write_bytes(packed)
    print(
        f"{len(text.splitlines())} lines, {len(data)} bytes of UTF-8 -> {args.out} ({len(packed)} bytes)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
