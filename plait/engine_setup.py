"""Pieces ``plait.engine.Engine`` assembles itself from: ZeRO-Offload options, LAMB's per-tensor
segments over ZeRO shards, activation checkpointing from the config, ZeRO-3 units of plait models,
and the loss of a model's output."""
from __future__ import annotations

import logging

import os

import torch
import torch.distributed as dist
from torch import nn

from plait.config import ConfigError, PlaitConfig
from plait.lamb import Lamb
from plait.parallel.mesh import ParallelMesh
from plait.parallel.sharding import shard_of
from plait.zero import ZeroOptimizer
from plait.zero.offload import OffloadOptions


def attach_lamb_segments(lamb: Lamb, zero: ZeroOptimizer, module: nn.Module, mesh: ParallelMesh) -> None:
    """Give LAMB the logical tensor of every piece of ZeRO's flat master shards, and a reduction
    that sums per-tensor squared norms over dp (pieces of one tensor on several dp ranks) and over
    tp (tensor-parallel shards; replicated tensors are counted once)."""
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    index = {n: i for i, n in enumerate(names)}
    params = dict(module.named_parameters())
    tp_split = torch.tensor([shard_of(params[n]).dim is not None for n in names], dtype=torch.float64,
                            device=mesh.device)
    segments = {id(master): [(pc.shard_offset, pc.length, index[pc.slot.name]) for pc in group.pieces()]
                for group, master in zip(zero.groups, zero.masters)}

    def reduce(sq: torch.Tensor) -> torch.Tensor:
        if zero.stage > 0 and mesh.dp > 1:
            dist.all_reduce(sq, group=mesh.dp_group)
        if mesh.tp > 1:
            split = sq * tp_split
            dist.all_reduce(split, group=mesh.tp_group)
            sq = split + sq * (1 - tp_split)
        return sq

    lamb.set_segments(segments, len(names), reduce)


def offload_options(config: PlaitConfig, pipeline, optimizer) -> OffloadOptions | None:
    """``OffloadOptions`` from ``zero_optimization.offload_optimizer`` / ``offload_param`` (None when both
    are off). ``pin_memory`` of either section pins the host buffers; the CPU optimizer's thread count
    comes from the environment variable ``PLAIT_OFFLOAD_THREADS`` (default: every core numba sees).

    Raises:
        ConfigError: offload with a pipeline, LAMB with offload_optimizer, a bad PLAIT_OFFLOAD_THREADS.
    """
    z = config.zero_optimization
    if not (z.offload_optimizer.enabled or z.offload_param.enabled):
        return None
    if pipeline is not None:
        raise ConfigError("zero_optimization.offload_optimizer / offload_param with pipeline parallelism is not "
                          "supported yet; remove the offload sections or use pipeline.size 1")
    kind = config.optimizer.type.lower() if optimizer is None and config.optimizer is not None else None
    if z.offload_optimizer.enabled and (kind == "lamb" or isinstance(optimizer, Lamb) or optimizer is Lamb):
        raise ConfigError("LAMB cannot run offloaded: its per-tensor trust ratio needs norms summed over the dp "
                          "ranks sharing a tensor, which the CPU kernels do not do; use Adam/AdamW/Lion with "
                          "offload_optimizer, or LAMB without it")
    threads = os.environ.get("PLAIT_OFFLOAD_THREADS")
    if threads is not None and not threads.isdigit():
        raise ConfigError(f"PLAIT_OFFLOAD_THREADS={threads!r} must be a positive integer (CPU optimizer threads)")
    return OffloadOptions(optimizer=z.offload_optimizer.enabled, param=z.offload_param.enabled,
                          pin_memory=z.offload_optimizer.pin_memory or z.offload_param.pin_memory,
                          num_threads=int(threads) if threads else None,
                          device_step_fraction="auto" if z.offload_optimizer.device_step_adaptive
                          else z.offload_optimizer.device_step_fraction)


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
                "compute device (the same results, more memory than DeepSpeed's variant)", key)
    if ac.number_checkpoints is None:
        return
    from plait.layers.block import TransformerBlock
    blocks = [m for m in module.modules() if isinstance(m, TransformerBlock)]
    for block in blocks[: ac.number_checkpoints]:
        block.recompute = "full"


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
        raise TypeError(f"train_batch needs the model to return a loss tensor or an output with .loss; got "
                        f"{type(output).__name__} (does the batch hold 'labels'?)")
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
