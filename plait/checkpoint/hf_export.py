"""Export: a plait checkpoint of any layout -> a Hugging Face model directory (``to_hf``).

Writes ``config.json`` plus ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` with
``model.safetensors.index.json`` when ``max_shard_bytes`` is set), loadable by
``transformers.AutoModelFor*.from_pretrained``. Vocabulary padding never reaches the files: plait
checkpoints hold logical shapes only. Runs in one process; memory peaks at one output shard plus
its inputs.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file

from plait import untrusted
from plait.checkpoint import hf as hfmap
from plait.checkpoint import hf_native
from plait.checkpoint.errors import CheckpointError, inside
from plait.checkpoint.hf_import import HF_CONFIG, HF_INDEX, HF_KEY, HF_WEIGHTS
from plait.checkpoint.index import OPTIMIZER_PREFIX
from plait.checkpoint.model_io import EXTRA_PREFIX, MODEL_CONFIG_KEY, config_from_meta
from plait.checkpoint.reader import CheckpointReader
from plait.layers.moe import MoE
from plait.dtypes import cast_floating, parse_dtype
from plait.layers.config import TransformerConfig
from plait.layers.model import logical_shapes

#: Files ``to_hf(tokenizer_from=...)`` copies when present (``fnmatch`` patterns, relative to the folder):
#: everything a transformers tokenizer or processor saves, chat templates included, and the generation config.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
    "*.jinja",
    "chat_template.json",
    "additional_chat_templates/*.jinja",
    "*.tiktoken",
    "spiece.model",
    "sentencepiece*.model",
    "preprocessor_config.json",
    "processor_config.json",
)


def parse_size(text: str | int | None) -> int | None:
    """Byte counts: ``"500MB"`` (10**6), ``"2GiB"`` (2**30), ``"1e9"``, ``123`` -> int; None stays None."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 500MB, 2GiB, 1e9)")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


@dataclass
class ExportReport:
    """Outcome of ``to_hf``: files written and what could not be exported."""

    out_dir: str
    architecture: str
    files: list[str]
    missing: list[str] = field(default_factory=list)  # plait parameters absent from the checkpoint
    dropped: list[str] = field(
        default_factory=list
    )  # checkpoint tensors with no place in this HF class


def _plan_shards(jobs: list, sizes: list[int], max_bytes: int | None) -> list[list]:
    groups, size = [[]], 0
    for job, n in zip(jobs, sizes):
        if max_bytes and groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(job)
        size += n
    return [g for g in groups if g]


def _nbytes(reader: CheckpointReader, name: str, dtype: torch.dtype | None) -> int:
    n = 1
    for s in reader.shape(name):
        n *= s
    stored = reader.dtype(name)
    return n * cast_floating(torch.empty(0, dtype=stored), dtype).element_size()


def _rule_jobs(
    reader: CheckpointReader, config: TransformerConfig, layout, names: list[str], dtype
):
    """(rules to write, their byte sizes, plait names they use, plait names missing) for ``layout``.

    Raises:
        CheckpointError: a fused group only partly present, or a shape that disagrees with ``config``.
    """
    shapes = logical_shapes(config)
    have, jobs, sizes, missing, used = set(names), [], [], [], set()
    for rule in hfmap.rules(config, layout):
        present = [p for p in rule.plait if p in have]
        if not present:
            missing.extend(rule.plait)
            continue
        if len(present) != len(rule.plait):
            raise CheckpointError(
                f"checkpoint {reader.path} has {present} but not "
                f"{sorted(set(rule.plait) - set(present))}, which {rule.hf} needs too"
            )
        for p in rule.plait:
            if reader.shape(p) != shapes.get(p):
                raise CheckpointError(
                    f"checkpoint {reader.path}: tensor {p!r} has shape {list(reader.shape(p))}, "
                    f"its model_config implies {list(shapes.get(p, ()))}"
                )
        used.update(rule.plait)
        jobs.append(rule)
        sizes.append(sum(_nbytes(reader, p, dtype) for p in rule.plait))
    return jobs, sizes, used, missing


def _zero_state(reader, name: str) -> bool:
    """A training-state buffer (``MoE.checkpointed_buffers``) that is all zeros, as Hugging Face has it implied
    (an expert bias never moved). A nonzero one stays and is reported as dropped."""
    if name.rpartition(".")[2] not in MoE.checkpointed_buffers:
        return False
    return not bool(reader.read(name).any())


def to_hf(
    plait_root: str,
    out_dir: str,
    tag: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int | str | None = None,
    *,
    config: TransformerConfig | None = None,
    overwrite: bool = False,
    tokenizer_from: str | None = None,
    hf_config: dict | str | None = None,
) -> ExportReport:
    """Write the plait checkpoint ``<plait_root>/<tag>`` (default: latest) as a Hugging Face model.

    Args:
        out_dir: created if needed; receives ``config.json`` and the safetensors weights.
        dtype: cast floating tensors (default: as stored).
        max_shard_bytes: split the weights into hub-style shards of at most this size (a tensor
            larger than it gets a shard of its own); None: one ``model.safetensors``.
        config: the architecture, when the checkpoint's meta has no ``model_config``.
        hf_config: a transformers model's config.json (path or dict) for a checkpoint of that model trained
            as it is (its own parameter names; ``plait.checkpoint.hf_native``); default: the one saved with it.
        overwrite: replace weights files already in ``out_dir`` (otherwise FileExistsError).
        tokenizer_from: a directory to copy the tokenizer and generation files from (e.g. the
            ``hf_dir`` of ``from_hf``; see :data:`TOKENIZER_FILES`); each must be a regular file inside it.

    Returns:
        ``ExportReport`` naming the HF class (``LlamaForCausalLM``, ``GPT2LMHeadModel``,
        ``BertForMaskedLM`` with an MLM head, else ``BertModel``), files, missing and dropped tensors.

    Raises:
        CheckpointError: no usable config, a tensor's shape disagrees with it, or a fused group is
            only partly present.
        ValueError: the config cannot be expressed as the HF class.
        CheckpointError: also, a tokenizer file that resolves outside ``tokenizer_from``, is not a regular
            file, or is larger than ``plait.untrusted.SMALL_FILE_CAP``.
    """
    dtype, max_shard_bytes = parse_dtype(dtype), parse_size(max_shard_bytes)
    reader = CheckpointReader(plait_root, tag)
    if isinstance(hf_config, (str, os.PathLike)):
        hf_config = untrusted.read_json(
            os.fspath(hf_config), "--hf-config file", error=CheckpointError
        )
    if config is None and MODEL_CONFIG_KEY not in reader.meta:
        return _native_to_hf(
            reader, out_dir, dtype, max_shard_bytes, overwrite, tokenizer_from, hf_config
        )
    config = config or config_from_meta(reader.meta, f"checkpoint {reader.path}")
    hf_meta = reader.meta.get(HF_KEY) or {}
    names = _weight_names(reader)
    layout = hfmap.export_layout(config, names)
    jobs, sizes, used, missing = _export_jobs(reader, config, layout, names, hf_meta, dtype)
    dropped = sorted(set(names) - used)
    shards = _plan_shards(jobs, sizes, max_shard_bytes)
    files = _write_hf_weights(reader, out_dir, shards, dtype, overwrite)
    _write_hf_config(reader, config, layout, hf_meta.get("config"), names, dtype, out_dir)
    files += _copy_tokenizer(tokenizer_from, out_dir) if tokenizer_from else []
    return ExportReport(os.fspath(out_dir), layout.architecture, files, sorted(missing), dropped)


def _weight_names(reader: CheckpointReader) -> list[str]:
    """The checkpoint's tensors less optimizer state and ZeRO training state (``_zero_state``)."""
    return [
        n
        for n in reader.names()
        if not n.startswith(OPTIMIZER_PREFIX) and not _zero_state(reader, n)
    ]


def _export_jobs(
    reader: CheckpointReader,
    config: TransformerConfig,
    layout,
    names: list[str],
    hf_meta: dict,
    dtype,
) -> tuple[list, list[int], set, list]:
    """``_rule_jobs``' (jobs, sizes, used names, missing) plus the ``hf_extra.`` tensors, kept when the
    checkpoint was imported from the same HF class and prefix."""
    jobs, sizes, used, missing = _rule_jobs(reader, config, layout, names, dtype)
    extras = [n for n in names if n.startswith(EXTRA_PREFIX)]
    keep_extras = (
        hf_meta.get("architecture") == layout.architecture
        and hf_meta.get("prefix") == layout.prefix
    )
    for n in extras if keep_extras else []:
        jobs.append(n)
        sizes.append(_nbytes(reader, n, dtype))
        used.add(n)
    return jobs, sizes, used, missing


def _write_hf_config(
    reader: CheckpointReader,
    config: TransformerConfig,
    layout,
    saved: dict | None,
    names: list[str],
    dtype,
    out_dir: str,
) -> None:
    """``config.json`` of the HF class (``saved``: the imported model's HF config, for fields plait does
    not keep), its dtype the export's, else the most common floating dtype stored."""
    hf_config = hfmap.config_to_hf(config, saved)
    hf_config.architectures = [layout.architecture]
    stored = Counter(reader.dtype(n) for n in names if reader.dtype(n).is_floating_point)
    out_dtype = dtype or (stored.most_common(1)[0][0] if stored else torch.float32)
    setattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", out_dtype)
    hf_config.to_json_file(os.path.join(out_dir, HF_CONFIG), use_diff=True)


def _native_to_hf(
    reader, out_dir, dtype, max_shard_bytes, overwrite, tokenizer_from, hf_config
) -> ExportReport:
    """A transformers model's checkpoint (its own names) -> the same names plus its config.json."""
    hf_cfg = hf_native.native_config(reader.meta, hf_config, f"checkpoint {reader.path}")
    arch, names, missing = hf_native.native_jobs(reader.names(), hf_cfg)
    files = _write_hf_weights(
        reader,
        out_dir,
        _plan_shards(names, [_nbytes(reader, n, dtype) for n in names], max_shard_bytes),
        dtype,
        overwrite,
    )
    stored = Counter(reader.dtype(n) for n in names if reader.dtype(n).is_floating_point)
    hf_native.write_config(
        hf_cfg, out_dir, dtype or (stored.most_common(1)[0][0] if stored else torch.float32)
    )
    files += _copy_tokenizer(tokenizer_from, out_dir) if tokenizer_from else []
    return ExportReport(os.fspath(out_dir), arch, files, missing, [])


def _copy_tokenizer(tokenizer_from: str, out_dir: str) -> list[str]:
    """Copy the files of ``tokenizer_from`` that match :data:`TOKENIZER_FILES` to ``out_dir``; each must resolve
    inside ``tokenizer_from`` and be a regular file of at most ``plait.untrusted.SMALL_FILE_CAP`` bytes (a link to
    a private file or an endless device is refused, naming it). Returns the names copied (sorted)."""
    present = [
        os.path.relpath(os.path.join(d, f), tokenizer_from).replace(os.sep, "/")
        for d in (tokenizer_from, os.path.join(tokenizer_from, "additional_chat_templates"))
        if os.path.isdir(d)
        for f in os.listdir(d)
    ]
    copied = sorted(
        f for f in present if any(fnmatch.fnmatchcase(f, pat) for pat in TOKENIZER_FILES)
    )
    for fname in copied:
        data = untrusted.read_small(
            inside(tokenizer_from, fname, "tokenizer file"), "tokenizer file", error=CheckpointError
        )
        os.makedirs(os.path.dirname(os.path.join(out_dir, fname)), exist_ok=True)
        with open(os.path.join(out_dir, fname), "wb") as f:
            f.write(data)
    return copied


def _shard_tensors(reader: CheckpointReader, shard: list, dtype) -> dict[str, torch.Tensor]:
    """HF name -> tensor of one output shard (rules through their transform, ``hf_extra`` tensors as stored)."""
    tensors = {}
    for job in shard:
        if isinstance(
            job, str
        ):  # an hf_extra tensor (or a transformers model's own), under its HF name
            tensors[job.removeprefix(EXTRA_PREFIX)] = cast_floating(reader.read(job), dtype)
            continue
        outs = hfmap.to_hf(job.kind, [reader.read(p) for p in job.plait])
        tensors.update({h: cast_floating(t, dtype).contiguous() for h, t in zip(job.hf, outs)})
    return {
        k: v.clone() if v.untyped_storage().nbytes() != v.numel() * v.element_size() else v
        for k, v in tensors.items()
    }


def _write_hf_weights(
    reader: CheckpointReader, out_dir: str, shards: list[list], dtype, overwrite: bool
) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    old = [
        f
        for f in os.listdir(out_dir)
        if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", f)
    ]
    if old and not overwrite:
        raise FileExistsError(
            f"{out_dir} already holds {sorted(old)}; pass overwrite=True (--overwrite) "
            f"or choose an empty directory"
        )
    for f in old:
        os.remove(os.path.join(out_dir, f))
    n = len(shards)
    fnames = (
        [HF_WEIGHTS] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    )
    weight_map, total = {}, 0
    for fname, shard in zip(fnames, shards):
        tensors = _shard_tensors(reader, shard, dtype)
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    if n > 1:
        with open(os.path.join(out_dir, HF_INDEX), "w") as f:
            json.dump(
                {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))},
                f,
                indent=2,
            )
        fnames.append(HF_INDEX)
    return fnames
