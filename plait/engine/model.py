"""What the engine needs to know about the model it wraps, plait's own or a Hugging Face one: the
loss in its output, the modules ZeRO-3 gathers as units, and activation checkpointing from the config."""

from __future__ import annotations

import logging

import torch
from torch import nn

from plait.parallel.pipeline.parallel import PipelineParallel


def loss_of(output) -> torch.Tensor:
    """The loss from a model's output: the tensor itself, or ``output.loss`` (Hugging Face models).

    Raises:
        TypeError: the output is neither (pass ``labels`` in the batch so the model computes a loss).
    """
    if torch.is_tensor(output):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if not torch.is_tensor(loss):
        raise TypeError(
            f"train_batch needs the model to return a loss tensor or an output with .loss; got "
            f"{type(output).__name__} (does the batch hold 'labels'?)"
        )
    return loss


def stage3_units(module: nn.Module):
    """The modules ZeRO-3 gathers as one unit each, or None for ZeRO's default (every module with
    parameters of its own).

    * plait models (and pipeline chunks): the embedding, each block and the head (their ``layers``);
    * Hugging Face models: every module whose class is named in the model's ``_no_split_modules`` (the
      decoder layers, as FSDP's default ``transformer_layer_cls_to_wrap``), and outside them each module with
      parameters of its own (embeddings, final norm, output head);
    * anything else: None.
    """
    chunks = list(module) if isinstance(module, nn.ModuleList) else [module]
    units = []
    for chunk in chunks:
        layers = getattr(chunk, "layers", None)
        if not (isinstance(layers, nn.ModuleDict) and hasattr(chunk, "config")):
            return _hf_units(module)
        units.extend(layers.values())
    return units


def _hf_units(module: nn.Module):
    blocks = set(getattr(module, "_no_split_modules", None) or ())
    if not blocks:
        return None
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        if type(m).__name__ in blocks:
            units.append(m)
            return
        if any(True for _ in m.parameters(recurse=False)):
            units.append(m)
        for child in m.children():
            visit(child)

    visit(module)
    return units if any(type(m).__name__ in blocks for m in units) else None


def apply_activation_checkpointing(module: nn.Module, ac) -> None:
    """Honour ds_config's ``activation_checkpointing`` on plait models: ``number_checkpoints`` = n
    recomputes the first n transformer blocks in backward (all of them when n is at least the block
    count); other models keep their own setting (e.g. ``model.gradient_checkpointing_enable()`` for
    transformers). Megatron's partitioned / CPU / contiguous variants only change where checkpointed
    activations are kept (the same results; DeepSpeed applies them only inside its own
    ``deepspeed.checkpointing.checkpoint``): plait keeps them whole on the device and says so once.
    """
    for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
        if getattr(ac, key):
            logging.getLogger("plait").warning(
                "config: activation_checkpointing.%s is accepted: checkpointed activations are kept whole on the "
                "compute device (the same results, more memory than DeepSpeed's variant)",
                key,
            )
    if ac.number_checkpoints is None:
        return
    from plait.layers.block import TransformerBlock

    blocks = [m for m in module.modules() if isinstance(m, TransformerBlock)]
    for block in blocks[: ac.number_checkpoints]:
        block.recompute = "full"


def as_groups(model_parameters) -> list[dict]:
    """``model_parameters`` as torch param groups, exactly as given: a list of dicts is used as is; an
    iterable of tensors (``model.parameters()``, a filter of it) is one group that takes the optimizer's
    options, weight decay included, as DeepSpeed and torch do."""
    items = list(model_parameters)
    if not items:
        raise ValueError("model_parameters is empty; pass model.parameters() or param-group dicts")
    if all(isinstance(g, dict) for g in items):
        return items
    if all(isinstance(p, torch.Tensor) for p in items):
        return [{"params": items}]
    raise TypeError(
        "model_parameters must be an iterable of parameters or of param-group dicts, not a mix of "
        + ", ".join(sorted({type(x).__name__ for x in items}))
    )


def on_device(model, device: torch.device):
    """``model`` moved to ``device`` (the rank's GPU) when its parameters live elsewhere, as DeepSpeed does; a
    ``PipelineParallel``'s chunks are built on their device, and a model on the meta device is left alone."""
    if isinstance(model, PipelineParallel):
        return model
    where = {p.device for p in model.parameters()}
    if where and torch.device("meta") not in where and where != {device}:
        model = model.to(device)
    return model


def to_device(batch: dict, device: torch.device) -> dict:
    """``batch`` with its tensors on ``device`` (copied without blocking the host)."""
    return {
        k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()
    }
