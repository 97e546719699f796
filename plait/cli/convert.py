"""``plait convert``: checkpoints from and to Hugging Face folders, consolidated, resharded, inspected."""

from __future__ import annotations

import argparse
import os
import sys

from plait.cli.common import cli_words


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    _configure_from_hf(sub)
    _configure_to_hf(sub)
    _configure_offline(sub)


def _configure_from_hf(sub) -> None:
    a = sub.add_parser(
        "from-hf", help="Hugging Face directory (config.json + safetensors) -> plait checkpoint"
    )
    a.add_argument("hf_dir", help="directory with config.json and model.safetensors (or its index)")
    a.add_argument("out_root", help="plait checkpoint root to write")
    a.add_argument("--tag", default="hf", help="checkpoint tag (default hf)")
    a.add_argument("--dtype", default=None, help="cast floating tensors: fp32, bf16, fp16")
    a.add_argument(
        "--gguf-file",
        default=None,
        help="a folder without config.json: its GGUF file to import "
        "(default: its only one; dequantized to fp32 by transformers, needs the gguf package)",
    )
    a.add_argument(
        "--hf-copy",
        default=None,
        help="GGUF input: also keep the dequantized Hugging Face folder here",
    )


def _configure_to_hf(sub) -> None:
    b = sub.add_parser("to-hf", help="plait checkpoint (any layout) -> Hugging Face directory")
    b.add_argument("root", help="plait checkpoint root")
    b.add_argument("out_dir", help="output directory (config.json + model*.safetensors)")
    b.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    b.add_argument("--dtype", default=None, help="cast floating tensors: fp32, bf16, fp16")
    b.add_argument(
        "--max-shard-size", default=None, help="split weights into shards, e.g. 5GB or 500MiB"
    )
    b.add_argument("--overwrite", action="store_true", help="replace weights already in out_dir")
    b.add_argument(
        "--tokenizer-from",
        default=None,
        help="copy the tokenizer, chat template and generation files from this directory",
    )
    b.add_argument(
        "--hf-config",
        default=None,
        help="the trained transformers model's original config.json "
        "(for checkpoints saved without it, e.g. by older plait versions)",
    )


def _configure_offline(sub) -> None:
    """consolidate, reshard and inspect: a plait checkpoint read and rewritten (or listed)."""
    c = sub.add_parser("consolidate", help="every logical tensor whole in one safetensors file")
    c.add_argument("root", help="plait checkpoint root")
    c.add_argument("out_file", help="output .safetensors file")
    c.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    c.add_argument("--dtype", default=None, help="cast floating tensors: fp32, bf16, fp16")
    c.add_argument(
        "--model-only", action="store_true", help="leave out optimizer state and hf_extra tensors"
    )
    e = sub.add_parser(
        "reshard",
        help="rewrite a checkpoint's files offline: every tensor whole, files of at most "
        "--max-file-size (no layout needs it: any tp/pp/dp loads any plait checkpoint)",
    )
    e.add_argument("root", help="plait checkpoint root")
    e.add_argument("out_root", help="new checkpoint root (training resumes from it)")
    e.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")
    e.add_argument(
        "--max-file-size",
        default=None,
        help="start a new file past this size, e.g. 5GB (default: one)",
    )
    d = sub.add_parser(
        "inspect", help="list tensors, shapes, dtypes, meta and files of a checkpoint"
    )
    d.add_argument("root", help="plait checkpoint root")
    d.add_argument("--tag", default=None, help="checkpoint tag (default: latest)")


def run(args: argparse.Namespace) -> int:
    from plait.checkpoint import CheckpointError

    source = args.hf_dir if args.action == "from-hf" else args.root
    if not os.path.isdir(source):
        what = "Hugging Face model folder" if args.action == "from-hf" else "checkpoint root"
        print(f"plait convert {args.action}: no such {what}: {source}", file=sys.stderr)
        return 2
    try:
        _CONVERT[args.action](args)
    except BrokenPipeError:
        raise  # not a checkpoint error: main() ends quietly
    except (CheckpointError, ValueError, OSError) as err:
        print(f"plait convert {args.action}: {cli_words(str(err))}", file=sys.stderr)
        return 2
    return 0


def _from_hf(args: argparse.Namespace) -> None:
    from plait.checkpoint import convert, hf_gguf

    gguf = args.gguf_file or hf_gguf.gguf_file(args.hf_dir)
    if gguf:
        r = hf_gguf.from_gguf(
            args.hf_dir, args.out_root, gguf, tag=args.tag, dtype=args.dtype, hf_copy=args.hf_copy
        )
    else:
        r = convert.from_hf(args.hf_dir, args.out_root, tag=args.tag, dtype=args.dtype)
    print(
        f"wrote {r.path}: {r.tensors} tensors from {r.architecture}"
        + (f" ({gguf}, dequantized)" if gguf else "")
    )
    for what, names in (
        ("missing (plait keeps its init)", r.missing),
        ("kept as hf_extra", r.extra),
    ):
        if names:
            print(f"  {what}: {', '.join(names)}")


def _to_hf(args: argparse.Namespace) -> None:
    from plait.checkpoint import convert

    r = convert.to_hf(
        args.root,
        args.out_dir,
        tag=args.tag,
        dtype=args.dtype,
        max_shard_bytes=args.max_shard_size,
        overwrite=args.overwrite,
        tokenizer_from=args.tokenizer_from,
        hf_config=args.hf_config,
    )
    print(f"wrote {r.architecture} to {r.out_dir}: {', '.join(r.files)}")
    for what, names in (("missing", r.missing), ("not exported", r.dropped)):
        if names:
            print(f"  {what}: {', '.join(names)}")


def _reshard(args: argparse.Namespace) -> None:
    from plait.checkpoint.hf_export import parse_size
    from plait.checkpoint.reshard import reshard

    r = reshard(
        args.root, args.out_root, tag=args.tag, max_file_bytes=parse_size(args.max_file_size)
    )
    print(
        f"wrote {r.path}: {r.tensors} tensors whole (were {r.slices_before} slices) in {len(r.files)} file(s)"
        + (
            ""
            if r.rng_kept
            else "; per-rank RNG states not carried (a resumed run reseeds, as after a layout "
            "change)"
        )
    )


def _consolidate(args: argparse.Namespace) -> None:
    from plait.checkpoint import convert

    print(
        "wrote "
        + convert.consolidate(
            args.root, args.out_file, tag=args.tag, dtype=args.dtype, model_only=args.model_only
        )
    )


def _inspect(args: argparse.Namespace) -> None:
    from plait.checkpoint import convert

    convert.inspect(args.root, tag=args.tag)


_CONVERT = {
    "from-hf": _from_hf,
    "to-hf": _to_hf,
    "consolidate": _consolidate,
    "inspect": _inspect,
    "reshard": _reshard,
}
