"""Checkpoint conversion: Hugging Face directories <-> plait checkpoints, consolidation, inspection.

- ``from_hf(hf_dir, out_root, tag="hf")``: a Hugging Face directory -> a plait checkpoint.
- ``to_hf(plait_root, out_dir)``: a plait checkpoint of any layout -> ``config.json`` plus safetensors
  weights loadable by ``transformers``.
- ``consolidate(plait_root, out_file)`` and ``inspect(plait_root)`` / ``describe``: every logical tensor
  whole in one file; a readable listing.
- ``from_gguf(folder, out_root)``: a GGUF-only folder, dequantized by transformers, -> a plait checkpoint;
  ``reshard(plait_root, out_root)``: the files rewritten offline, every tensor whole.

This module keeps the names the ``plait convert`` command and users import; each lives in its own module
of ``plait.checkpoint`` (``docs/checkpoints.md``), and the per-architecture name rules in ``plait.models``.
"""

from plait.checkpoint.hf_export import TOKENIZER_FILES, ExportReport, parse_size, to_hf
from plait.checkpoint.hf_import import (
    HF_CONFIG,
    HF_INDEX,
    HF_KEY,
    HF_WEIGHTS,
    ConvertReport,
    HFWeights,
    from_hf,
    read_hf_config,
)
from plait.checkpoint.hf_gguf import from_gguf
from plait.checkpoint.inspection import consolidate, describe, inspect
from plait.checkpoint.reshard import ReshardReport, reshard
from plait.dtypes import parse_dtype

__all__ = [
    "ConvertReport",
    "ExportReport",
    "HFWeights",
    "HF_CONFIG",
    "HF_INDEX",
    "HF_KEY",
    "HF_WEIGHTS",
    "ReshardReport",
    "TOKENIZER_FILES",
    "consolidate",
    "describe",
    "from_gguf",
    "from_hf",
    "inspect",
    "parse_dtype",
    "parse_size",
    "read_hf_config",
    "reshard",
    "to_hf",
]
