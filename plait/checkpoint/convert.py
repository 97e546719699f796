"""Checkpoint conversion: Hugging Face directories <-> plait checkpoints, consolidation, inspection.

- ``from_hf(hf_dir, out_root, tag="hf")``: a Hugging Face directory (``config.json`` plus
  ``model.safetensors`` or hub-style shards listed in ``model.safetensors.index.json``, read
  lazily with safetensors) -> a plait checkpoint of whole logical tensors. ``meta.json`` holds
  the ``TransformerConfig`` (``model_config``) and what the import saw (``hf``: model_type,
  architecture, name prefix, carried config fields such as token ids, missing plait tensors and
  HF tensors kept as ``hf_extra.<hf name>``, e.g. BERT's pooler, which plait has no layer for).
- ``to_hf(plait_root, out_dir)``: a plait checkpoint of any layout -> ``config.json`` plus
  ``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` with
  ``model.safetensors.index.json`` when ``max_shard_bytes`` is set), loadable by
  ``transformers.AutoModelFor*.from_pretrained``. Vocabulary padding never reaches the files:
  plait checkpoints hold logical shapes only.
- ``consolidate(plait_root, out_file)``: every logical tensor whole in one safetensors file.
- ``inspect(plait_root)``: a readable listing of tensors, shapes, dtypes, meta and files.

Pickled ``pytorch_model.bin`` files are not read (re-save them with ``safe_serialization=True``).
Everything here runs in one process; memory peaks at the model's size (``from_hf``,
``consolidate``) or at one output shard plus its inputs (``to_hf``).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from plait.checkpoint import hf as hfmap
from plait.checkpoint.errors import CheckpointError, read_json
from plait.checkpoint.index import OPTIMIZER_PREFIX
from plait.checkpoint.model_io import EXTRA_PREFIX, MESH_KEY, MODEL_CONFIG_KEY, config_from_meta
from plait.checkpoint.reader import CheckpointReader
from plait.checkpoint.writer import CheckpointWriter, ShardItem
from plait.layers.config import TransformerConfig

HF_KEY = "hf"                                   # meta.json: what from_hf saw
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
HF_CONFIG = "config.json"
#: Files ``to_hf(tokenizer_from=...)`` copies when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "generation_config.json")

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}


def parse_dtype(text: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` -> ``torch.bfloat16`` (also fp16, fp32, fp64); None stays None."""
    if text is None or isinstance(text, torch.dtype):
        return text
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {text!r}; use one of {sorted(DTYPES)}") from None


def parse_size(text: str | int | None) -> int | None:
    """Byte counts: ``"500MB"`` (10**6), ``"2GiB"`` (2**30), ``"1e9"``, ``123`` -> int; None stays None."""
    if text is None or isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][0-9]+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"not a size: {text!r} (e.g. 500MB, 2GiB, 1e9)")
    base = 1024 if m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _logical_shapes(config: TransformerConfig) -> dict[str, tuple[int, ...]]:
    from plait.layers.model import TransformerModel
    from plait.parallel.sharding import shard_of

    model = TransformerModel(config, device="meta")
    return {n: tuple(shard_of(p).logical_shape) for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------- HF input
class HFWeights:
    """Lazy read access to the safetensors weights of a Hugging Face model directory.

    Raises:
        FileNotFoundError: neither ``model.safetensors`` nor ``model.safetensors.index.json``
            (or a shard it lists) exists in ``hf_dir``.
    """

    def __init__(self, hf_dir: str):
        self.dir = os.fspath(hf_dir)
        single, index = os.path.join(self.dir, HF_WEIGHTS), os.path.join(self.dir, HF_INDEX)
        self._handles: dict[str, object] = {}
        if os.path.isfile(single):
            self.file_of = dict.fromkeys(self._open(single).keys(), single)
        elif os.path.isfile(index):
            weight_map = read_json(index, "Hugging Face weight index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no 'weight_map' dict")
            self.file_of = {k: os.path.join(self.dir, v) for k, v in weight_map.items()}
            for path in sorted(set(self.file_of.values())):
                if not os.path.isfile(path):
                    raise FileNotFoundError(f"{index} lists {os.path.basename(path)}, which is not in {self.dir}")
        else:
            raise FileNotFoundError(f"{self.dir} has neither {HF_WEIGHTS} nor {HF_INDEX}; pickled "
                                    f"pytorch_model.bin files are not read: re-save the model with "
                                    f"save_pretrained(..., safe_serialization=True)")

    def _open(self, path: str):
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt", device="cpu")
        return self._handles[path]

    def names(self) -> list[str]:
        return sorted(self.file_of)

    def get(self, name: str) -> torch.Tensor:
        path = self.file_of[name]
        handle = self._open(path)
        if name not in set(handle.keys()):
            raise CheckpointError(f"{path} has no tensor {name!r}, though {HF_INDEX} lists it there")
        return handle.get_tensor(name)


def read_hf_config(hf_dir: str) -> dict:
    """The parsed ``config.json`` of ``hf_dir`` (FileNotFoundError naming the path if absent)."""
    path = os.path.join(os.fspath(hf_dir), HF_CONFIG)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: a Hugging Face model directory needs its config.json")
    return read_json(path, "Hugging Face config")


@dataclass
class ConvertReport:
    """Outcome of ``from_hf``: where the checkpoint went and what did not map one to one."""

    path: str
    tag: str
    config: TransformerConfig
    architecture: str
    tensors: int
    missing: list[str] = field(default_factory=list)   # plait parameters with no HF tensor (keep init on load)
    extra: list[str] = field(default_factory=list)     # HF tensors kept as hf_extra.<name>
    ignored: list[str] = field(default_factory=list)   # HF buffers / tied copies not stored


def from_hf(hf_dir: str, out_root: str, tag: str = "hf", dtype: str | torch.dtype | None = None,
            max_file_bytes: int | None = None) -> ConvertReport:
    """Convert the Hugging Face model in ``hf_dir`` into the plait checkpoint ``<out_root>/<tag>``.

    Args:
        hf_dir: directory with ``config.json`` and safetensors weights (single or sharded).
        out_root: plait checkpoint root (``latest`` is pointed at ``tag``).
        dtype: cast floating tensors (default: keep the stored dtype).
        max_file_bytes: split the checkpoint's file at this size.

    Returns:
        ``ConvertReport``; ``missing`` lists plait parameters without an HF tensor (e.g. the MLM
        head of a plain ``BertModel``), which ``load_model_weights(strict=False)`` leaves at init.

    Raises:
        ValueError: unsupported model_type or architecture feature.
        CheckpointError: a tensor's shape disagrees with the config (names both), or a fused
            tensor is only partly present.
        RuntimeError: called inside a multi-process ``torch.distributed`` job (run it in one process).
    """
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError("from_hf runs in one process; call it before torch.distributed is initialized "
                           "or use the `plait convert from-hf` command")
    dtype = parse_dtype(dtype)
    raw = read_hf_config(hf_dir)
    config = hfmap.config_from_hf(raw)
    weights = HFWeights(hf_dir)
    hf_names = set(weights.names())
    layout = hfmap.detect_layout(raw["model_type"], hf_names)
    shapes = _logical_shapes(config)
    items, used = [], set()
    for rule in hfmap.rules(config, layout):
        present = [h for h in rule.hf if h in hf_names]
        if not present and rule.hf == ("cls.predictions.bias",) and "cls.predictions.decoder.bias" in hf_names:
            rule, present = hfmap.Rule(rule.plait, ("cls.predictions.decoder.bias",)), ["cls.predictions.decoder.bias"]
        if not present:
            continue
        if len(present) != len(rule.hf):
            raise CheckpointError(f"{hf_dir}: has {present} but not {sorted(set(rule.hf) - set(present))}")
        used.update(rule.hf)
        for name, tensor in zip(rule.plait, hfmap.to_plait(rule.kind, [weights.get(h) for h in rule.hf])):
            if tuple(tensor.shape) != shapes[name]:
                raise CheckpointError(f"{hf_dir}: {rule.hf} gives plait tensor {name!r} shape "
                                      f"{list(tensor.shape)}, but config.json implies {list(shapes[name])}")
            items.append(ShardItem.whole(name, _cast(tensor, dtype)))
    leftover = sorted(hf_names - used)
    ignored = [n for n in leftover if hfmap.ignored_hf_name(n, config)]
    extra = [n for n in leftover if n not in set(ignored)]
    items += [ShardItem.whole(EXTRA_PREFIX + n, _cast(weights.get(n), dtype)) for n in extra]
    missing = sorted(set(shapes) - {it.name for it in items})
    meta = {MODEL_CONFIG_KEY: config.to_dict(),
            HF_KEY: {"model_type": layout.model_type, "architecture": layout.architecture, "prefix": layout.prefix,
                     "source": os.path.abspath(hf_dir),
                     "config": {k: raw[k] for k in hfmap.CARRIED_FIELDS if k in raw},
                     "missing": missing, "extra": extra}}
    CheckpointWriter(out_root, max_file_bytes=max_file_bytes).save(tag, items, meta)
    return ConvertReport(os.path.join(os.fspath(out_root), tag), tag, config, layout.architecture,
                         len(items), missing, extra, ignored)


# ------------------------------------------------------------------------------------- HF output
@dataclass
class ExportReport:
    """Outcome of ``to_hf``: files written and what could not be exported."""

    out_dir: str
    architecture: str
    files: list[str]
    missing: list[str] = field(default_factory=list)   # plait parameters absent from the checkpoint
    dropped: list[str] = field(default_factory=list)   # checkpoint tensors with no place in this HF class


def _plan_shards(jobs: list, sizes: list[int], max_bytes: int | None) -> list[list]:
    groups, size = [[]], 0
    for job, n in zip(jobs, sizes):
        if max_bytes and groups[-1] and size + n > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(job)
        size += n
    return [g for g in groups if g]


def to_hf(plait_root: str, out_dir: str, tag: str | None = None, dtype: str | torch.dtype | None = None,
          max_shard_bytes: int | str | None = None, *, config: TransformerConfig | None = None,
          overwrite: bool = False, tokenizer_from: str | None = None) -> ExportReport:
    """Write the plait checkpoint ``<plait_root>/<tag>`` (default: latest) as a Hugging Face model.

    Args:
        out_dir: created if needed; receives ``config.json`` and the safetensors weights.
        dtype: cast floating tensors (default: as stored).
        max_shard_bytes: split the weights into hub-style shards of at most this size (a tensor
            larger than it gets a shard of its own); None: one ``model.safetensors``.
        config: the architecture, when the checkpoint's meta has no ``model_config``.
        overwrite: replace weights files already in ``out_dir`` (otherwise FileExistsError).
        tokenizer_from: a directory to copy the tokenizer and generation files from (e.g. the
            ``hf_dir`` of ``from_hf``; see :data:`TOKENIZER_FILES`).

    Returns:
        ``ExportReport`` naming the HF class (``LlamaForCausalLM``, ``GPT2LMHeadModel``,
        ``BertForMaskedLM`` with an MLM head, else ``BertModel``), files, missing and dropped tensors.

    Raises:
        CheckpointError: no usable config, a tensor's shape disagrees with it, or a fused group is
            only partly present.
        ValueError: the config cannot be expressed as the HF class.
    """
    dtype, max_shard_bytes = parse_dtype(dtype), parse_size(max_shard_bytes)
    reader = CheckpointReader(plait_root, tag)
    config = config or config_from_meta(reader.meta, f"checkpoint {reader.path}")
    hf_meta = reader.meta.get(HF_KEY) or {}
    names = [n for n in reader.names() if not n.startswith(OPTIMIZER_PREFIX)]
    layout = hfmap.export_layout(config, names)
    shapes = _logical_shapes(config)
    have, jobs, sizes, missing, used = set(names), [], [], [], set()
    for rule in hfmap.rules(config, layout):
        present = [p for p in rule.plait if p in have]
        if not present:
            missing.extend(rule.plait)
            continue
        if len(present) != len(rule.plait):
            raise CheckpointError(f"checkpoint {reader.path} has {present} but not "
                                  f"{sorted(set(rule.plait) - set(present))}, which {rule.hf} needs too")
        for p in rule.plait:
            if reader.shape(p) != shapes.get(p):
                raise CheckpointError(f"checkpoint {reader.path}: tensor {p!r} has shape {list(reader.shape(p))}, "
                                      f"its model_config implies {list(shapes.get(p, ()))}")
        used.update(rule.plait)
        jobs.append(rule)
        sizes.append(sum(_nbytes(reader, p, dtype) for p in rule.plait))
    extras = [n for n in names if n.startswith(EXTRA_PREFIX)]
    keep_extras = hf_meta.get("architecture") == layout.architecture and hf_meta.get("prefix") == layout.prefix
    for n in extras if keep_extras else []:
        jobs.append(n)
        sizes.append(_nbytes(reader, n, dtype))
        used.add(n)
    dropped = sorted(set(names) - used)
    files = _write_hf_weights(reader, out_dir, _plan_shards(jobs, sizes, max_shard_bytes), dtype, overwrite)
    hf_config = hfmap.config_to_hf(config, hf_meta.get("config"))
    hf_config.architectures = [layout.architecture]
    stored = Counter(reader.dtype(n) for n in names if reader.dtype(n).is_floating_point)
    out_dtype = dtype or (stored.most_common(1)[0][0] if stored else torch.float32)
    setattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", out_dtype)
    hf_config.to_json_file(os.path.join(out_dir, HF_CONFIG), use_diff=True)
    for fname in TOKENIZER_FILES if tokenizer_from else ():
        if os.path.isfile(os.path.join(tokenizer_from, fname)):
            shutil.copyfile(os.path.join(tokenizer_from, fname), os.path.join(out_dir, fname))
            files.append(fname)
    return ExportReport(os.fspath(out_dir), layout.architecture, files, sorted(missing), dropped)


def _nbytes(reader: CheckpointReader, name: str, dtype: torch.dtype | None) -> int:
    n = 1
    for s in reader.shape(name):
        n *= s
    stored = reader.dtype(name)
    return n * _cast(torch.empty(0, dtype=stored), dtype).element_size()


def _write_hf_weights(reader: CheckpointReader, out_dir: str, shards: list[list], dtype, overwrite: bool) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    old = [f for f in os.listdir(out_dir) if re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?", f)]
    if old and not overwrite:
        raise FileExistsError(f"{out_dir} already holds {sorted(old)}; pass overwrite=True (--overwrite) "
                              f"or choose an empty directory")
    for f in old:
        os.remove(os.path.join(out_dir, f))
    n = len(shards)
    fnames = [HF_WEIGHTS] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map, total = {}, 0
    for fname, shard in zip(fnames, shards):
        tensors = {}
        for job in shard:
            if isinstance(job, str):      # an hf_extra tensor, written back under its HF name
                tensors[job[len(EXTRA_PREFIX):]] = _cast(reader.read(job), dtype)
                continue
            outs = hfmap.to_hf(job.kind, [reader.read(p) for p in job.plait])
            tensors.update({h: _cast(t, dtype).contiguous() for h, t in zip(job.hf, outs)})
        tensors = {k: v.clone() if v.untyped_storage().nbytes() != v.numel() * v.element_size() else v
                   for k, v in tensors.items()}
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    if n > 1:
        with open(os.path.join(out_dir, HF_INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        fnames.append(HF_INDEX)
    return fnames


# ------------------------------------------------------------------------------------- consolidate / inspect
def consolidate(plait_root: str, out_file: str, tag: str | None = None, dtype: str | torch.dtype | None = None,
                model_only: bool = False) -> str:
    """Write every logical tensor of ``<plait_root>/<tag>`` whole into one safetensors file.

    Names stay plait's logical names (``optimizer.exp_avg.<param>`` etc. too unless ``model_only``,
    which also drops ``hf_extra.`` tensors). ``dtype`` casts floating tensors. The header metadata
    holds ``plait_tag`` and ``plait_meta`` (meta.json as JSON text). Returns ``out_file``.
    """
    dtype = parse_dtype(dtype)
    reader = CheckpointReader(plait_root, tag)
    names = [n for n in reader.names()
             if not model_only or not n.startswith((OPTIMIZER_PREFIX, EXTRA_PREFIX))]
    tensors = {n: _cast(reader.read(n), dtype) for n in names}
    parent = os.path.dirname(os.path.abspath(out_file))
    os.makedirs(parent, exist_ok=True)
    tmp = f"{out_file}.tmp-{os.getpid()}"
    save_file(tensors, tmp, metadata={"format": "pt", "plait_tag": reader.tag,
                                      "plait_meta": json.dumps(reader.meta, sort_keys=True)})
    os.replace(tmp, out_file)
    return os.fspath(out_file)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def describe(plait_root: str, tag: str | None = None) -> str:
    """The text ``inspect`` prints: header, meta summary, one line per tensor, files and sizes."""
    r = CheckpointReader(plait_root, tag, verify="size")
    idx, meta = r.index, r.meta
    lines = [f"checkpoint {r.path}",
             (f"  tag {r.tag}, saved {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(idx['saved_at']))}, "
              f"{idx['writers']} writer rank(s), fingerprint {idx['model_fingerprint']}")]
    counters = {**meta, **(meta.get("engine") if isinstance(meta.get("engine"), dict) else {})}
    steps = {k: v for k, v in counters.items()
             if ("step" in k or "sample" in k or k == "zero_stage") and isinstance(v, (int, float))}
    if steps:
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in sorted(steps.items())))
    if isinstance(meta.get(MESH_KEY), dict):
        lines.append("  saved from mesh " + ", ".join(f"{k}={v}" for k, v in meta[MESH_KEY].items()))
    cfg = meta.get(MODEL_CONFIG_KEY)
    if isinstance(cfg, dict):
        keys = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size")
        lines.append("  model " + ", ".join(f"{k}={cfg.get(k)}" for k in keys))
    if isinstance(meta.get(HF_KEY), dict):
        h = meta[HF_KEY]
        lines.append(f"  from Hugging Face {h.get('architecture')} ({h.get('source')}); "
                     f"missing {len(h.get('missing', []))}, kept extra {len(h.get('extra', []))}")
    names = r.names()
    width = max([len(n) for n in names] + [4])
    lines.append(f"\n  {'name':<{width}}  {'shape':<20} {'dtype':<9} slices")
    total, count = 0, 0
    for n in names:
        e = r.index["tensors"][n]
        numel = 1
        for s in e["shape"]:
            numel *= s
        count += numel if not n.startswith((OPTIMIZER_PREFIX, EXTRA_PREFIX)) else 0
        total += numel * torch.empty(0, dtype=r.dtype(n)).element_size()
        lines.append(f"  {n:<{width}}  {e['shape']!s:<20} {e['dtype']:<9} {len(e['slices'])}")
    lines.append(f"\n  {len(names)} tensors, {count:,} model-weight elements, {_human(total)} of tensor data")
    lines.append("  files:")
    for fname, info in sorted(idx["files"].items()):
        lines.append(f"    {fname:<32} {_human(info['bytes']):>10}")
    return "\n".join(lines)


def inspect(plait_root: str, tag: str | None = None, file=None) -> str:
    """Print ``describe(plait_root, tag)`` to ``file`` (default stdout) and return it."""
    text = describe(plait_root, tag)
    print(text, file=file or sys.stdout)
    return text
