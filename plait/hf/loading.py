"""A Hugging Face model built without its weights, for ``plait.hf.Trainer`` to read rank by rank (the role
DeepSpeed's ``zero.Init`` plays inside ``from_pretrained`` when the Trainer's arguments ask for ZeRO-3).

    from plait.hf import Trainer, TrainingArguments, from_pretrained
    args = TrainingArguments(output_dir="out", deepspeed="ds_config_zero3.json", ...)
    model = from_pretrained(transformers.AutoModelForCausalLM, "path/or/hub-id")   # no memory for weights
    Trainer(model=model, args=args, train_dataset=ds).train()

The model is built from the checkpoint's config under ``plait.zero.meta_parameters()``; the Trainer's
engine then reads its weights from the checkpoint's safetensors files: under ZeRO-3 each rank reads only
the elements of its own shards (``plait.zero.weights``), so no rank ever holds the whole model.
"""

from __future__ import annotations

import os

from torch import nn

from plait.zero.weights import meta_parameters

WEIGHT_FILES = ["*.json", "*.safetensors"]


def from_pretrained(model_class, name_or_path: str | os.PathLike, **config_kwargs) -> nn.Module:
    """``model_class`` (a ``transformers`` model class or auto class, e.g. ``LlamaForCausalLM`` or
    ``AutoModelForCausalLM``) with the checkpoint's config and its parameters on the meta device; the
    checkpoint folder is recorded as ``model.config.name_or_path``, where ``plait.hf.Trainer`` reads the
    weights from. ``config_kwargs`` override config fields, as ``from_pretrained``'s do.

    Before transformers reads the folder, its files are checked as any file from elsewhere is
    (``plait.untrusted``: inside the folder, regular, config and index read with a bound) and the config's
    sizes (with ``config_kwargs``) are checked against the weight files (``plait.checkpoint.hf.check_hf_sizes``).

    Raises:
        FileNotFoundError: the folder (or the Hub snapshot) holds no safetensors weights.
        ValueError: a config size that is not a positive whole number, or sizes implying far more weights than
            the folder holds (names the key).
        CheckpointError: a file the folder names resolves outside it, or is not a regular file, or too large.
    """
    import transformers

    from plait.checkpoint.convert import HF_CONFIG, HFWeights, read_hf_config
    from plait.checkpoint.hf import check_hf_sizes

    folder = os.fspath(name_or_path)
    if not os.path.isdir(folder):
        from huggingface_hub import snapshot_download

        folder = snapshot_download(folder, allow_patterns=WEIGHT_FILES)
    weights = HFWeights(folder)
    check_hf_sizes(
        {**read_hf_config(folder), **config_kwargs}, os.path.join(folder, HF_CONFIG), weights.nbytes
    )
    config = transformers.AutoConfig.from_pretrained(folder, **config_kwargs)
    with meta_parameters():
        if hasattr(model_class, "from_config"):  # an auto class
            model = model_class.from_config(config)
        else:
            model = model_class(config)
    model.config.name_or_path = folder
    return model
