"""Train the bundled byte-level BPE tokenizer (``examples/data/tokenizer.json``) on the bundled corpus.

    python examples/data/train_tokenizer.py [--vocab-size 8192] [--out examples/data/tokenizer.json]

Model: byte-level BPE (GPT-2 style: Sennrich et al. 2016, "Neural Machine Translation of Rare Words
with Subword Units"; bytes mapped to printable characters as in Radford et al. 2019), built with the
Hugging Face ``tokenizers`` library. No normalizer and no prefix space, so ``decode(encode(text))``
returns ``text`` exactly for any UTF-8 string. Special tokens take the first ids, in this order:

    0 [PAD]   1 [UNK]   2 [CLS]   3 [SEP]   4 [MASK]   5 <|endoftext|>

``<|endoftext|>`` separates documents in GPT-style pretraining streams; the bracketed ones are for
BERT-style masked-language-model batches. The default vocabulary (8192) is a multiple of 128 so no
padding is needed for tensor parallelism up to 64.
"""

from __future__ import annotations

import argparse
import lzma
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<|endoftext|>"]


def train(lines: list[str], vocab_size: int = 8192) -> Tokenizer:
    """Train a byte-level BPE with ``vocab_size`` entries (special tokens and 256 bytes included)."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return tok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", type=Path, default=HERE / "web_bible.txt.xz")
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--out", type=Path, default=HERE / "tokenizer.json")
    args = parser.parse_args(argv)
    text = lzma.decompress(args.corpus.read_bytes()).decode("utf-8")
    # One training "sentence" per line, newline kept so the tokenizer learns line breaks.
    lines = [line + "\n" for line in text.split("\n") if line]
    tok = train(lines, args.vocab_size)
    tok.save(str(args.out), pretty=False)
    print(f"vocab {tok.get_vocab_size()} -> {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
