"""Build a model without its weights and let each rank read only its own part of them (DeepSpeed's
``zero.Init`` role, for ZeRO-3)::

    with plait.zero.meta_parameters():                  # parameters on the meta device, buffers real
        model = transformers.LlamaForCausalLM(config)
    engine = plait.initialize(model, ds_config, weights="path/to/hf_checkpoint")

``ZeroOptimizer`` fills its flat buffers from a ``WeightSource``: under ZeRO-3 a rank reads only its
shard of each segment (and the small persistent parameters whole); under stages 0-2 whole parameters.
``SafetensorsWeights`` reads a Hugging Face checkpoint folder through safetensors' lazy slices.
More: ``docs/zero.md``.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from plait.untrusted import hf_weight_files


class WeightSource(Protocol):
    """Where ``ZeroOptimizer`` reads parameter values from (a source may also offer ``shape(name)``, which
    ``place_meta_parameters`` then checks against the model)."""

    def read(self, name: str, start: int, length: int) -> torch.Tensor:
        """Elements ``[start, start + length)`` of parameter ``name`` flattened, as a float32 ``[length]``."""
        ...


class SafetensorsWeights:
    """A Hugging Face checkpoint folder as a ``WeightSource``; ``elements_read`` counts what was read.

    Raises:
        FileNotFoundError: the folder holds neither ``model.safetensors`` nor its index.
        plait.untrusted.UntrustedFileError: the index is damaged, or names a file outside the folder or not
            a regular file (``plait.untrusted.hf_weight_files``).
        KeyError (from ``read``): a parameter the checkpoint does not hold, named with the folder.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self.files = hf_weight_files(self.path)
        self.elements_read = 0

    def _file(self, name: str) -> str:
        if name not in self.files:
            raise KeyError(
                f"parameter {name!r} is not in the checkpoint {self.path} ({len(self.files)} tensors)"
            )
        return self.files[name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The checkpoint's shape of ``name``. Raises KeyError for a tensor it does not hold."""
        from safetensors import safe_open

        with safe_open(self._file(name), "pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def read(self, name: str, start: int, length: int) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._file(name), "pt") as f:
            part = f.get_slice(name)
            shape = part.get_shape()
            if len(shape) == 0:
                flat = f.get_tensor(name).reshape(-1)[start : start + length]
            elif len(shape) == 1:
                flat = part[start : start + length]
            else:
                row = math.prod(shape[1:])
                first, last = start // row, -(-(start + length) // row)
                flat = part[first:last].reshape(-1)[
                    start - first * row : start - first * row + length
                ]
        self.elements_read += length
        return flat.to(torch.float32).reshape(-1)


@contextmanager
def meta_parameters():
    """Inside, every parameter a module registers is moved to the meta device as it is registered (its
    initialisation then runs on meta, at no cost); buffers are left as built. Not thread-safe: it swaps
    ``nn.Module.register_parameter`` for the duration."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and param.device.type != "meta":
            meta = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(param.__dict__)
            param = meta
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def place_meta_parameters(module: nn.Module, device: torch.device, source: WeightSource) -> int:
    """Place each meta parameter of ``module`` on ``device``, in place (``torch.utils.swap_tensors``: the same
    ``Parameter`` object, so an optimizer or a tie built on the meta model still holds it): a trainable one
    as a placeholder (same shape, dtype, ``requires_grad`` and attributes, one element of storage, all
    strides 0) that ``ZeroOptimizer`` fills from ``source``; a frozen one (which no optimizer lays out) with
    its values read whole from ``source``. Buffers move to ``device``. Returns how many were placed.

    Raises:
        ValueError: the checkpoint holds a parameter in another shape (both named).
    """
    placed = 0
    for prefix, sub in module.named_modules():
        for name, p in list(sub._parameters.items()):
            if p is None or p.device.type != "meta":
                continue
            full = f"{prefix}.{name}" if prefix else name
            _check_shape(source, full, p.shape)
            if p.requires_grad:
                data = torch.empty_strided(p.shape, [0] * p.dim(), dtype=p.dtype, device=device)
            else:
                data = source.read(full, 0, p.numel()).to(device, p.dtype).reshape(p.shape)
            new = nn.Parameter(data, requires_grad=p.requires_grad)
            new.__dict__.update(p.__dict__)
            torch.utils.swap_tensors(
                p, new
            )  # the same Parameter object: optimizers and ties built on it hold
            placed += 1
        for name, b in list(sub._buffers.items()):
            if b is not None and b.device != device:
                sub._buffers[name] = b.to(device)
    return placed


def _check_shape(source, name: str, shape: torch.Size) -> None:
    want = getattr(source, "shape", None)
    if want is not None and tuple(want(name)) != tuple(shape):
        raise ValueError(
            f"parameter {name!r} is {tuple(shape)} in the model but {tuple(want(name))} in the "
            f"checkpoint; build the model with the checkpoint's config"
        )


def has_meta_parameters(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is on the meta device (built under ``meta_parameters``)."""
    return any(p.device.type == "meta" for p in model.parameters())


def prepare_weights(model: nn.Module, weights, device: torch.device):
    """``plait.initialize``'s ``weights=``: None for a model whose parameters hold values; for a model built
    under ``meta_parameters`` its placeholders are placed on ``device`` and the ``WeightSource`` returned
    (a checkpoint folder path becomes ``SafetensorsWeights``).

    Raises:
        ValueError: meta parameters without ``weights``, ``weights`` for a model without meta parameters,
            or a checkpoint tensor of another shape.
        KeyError: a parameter the checkpoint does not hold.
    """
    meta = has_meta_parameters(model)
    if weights is None:
        if meta:
            raise ValueError(
                "the model's parameters are on the meta device (built under meta_parameters() or "
                "torch.device('meta')): pass weights= (a Hugging Face checkpoint folder) to initialize"
            )
        return None
    if not meta:
        raise ValueError(
            "weights= fills a model built under plait.zero.meta_parameters() (parameters on the meta "
            "device); this model's parameters hold values already: drop weights="
        )
    source = SafetensorsWeights(weights) if isinstance(weights, (str, os.PathLike)) else weights
    place_meta_parameters(model, device, source)
    return source
