"""Float8 training (the ds_config's ``fp8`` section) through torchao's float8 recipes, applied in one place.

``convert_to_float8`` swaps, in place, every linear layer of a model that float8 serves: plait's
``ColumnParallelLinear`` and ``RowParallelLinear`` for the layers of ``plait.precision.float8_layers``, a
Hugging Face model's ``nn.Linear`` for torchao's ``Float8Linear``. Left in high precision: modules matched by
``fp8.exclude``, layers whose local weight is not a multiple of 16 in both dimensions, plait's ``LMHead``,
embeddings and MoE routers; plait's ``MoE`` experts run their grouped GEMMs through torchao's rowwise
float8 grouped GEMM where it serves, else stay in high precision saying why (``plait.precision.float8_moe``).
Parameter tensors are kept (names, dtypes, ZeRO's flat buffers, checkpoints); the swap must run before
``torch.compile`` and before ZeRO collects parameters, and ``plait.engine`` calls it first. Sources
(torchao's ``Float8LinearConfig``; Micikevicius et al., "FP8 Formats for Deep Learning", 2022) and the
reasons for each rule: ``docs/kernels.md``.
"""

from __future__ import annotations

import dataclasses
import logging
from fnmatch import fnmatchcase

import torch
import torch.distributed as dist
from torch import nn

from plait.config.schema_base import ConfigError
from plait.config.schema_fp8 import DEFAULT_EXCLUDE, FP8Config
from plait.layers.linear import ColumnParallelLinear, RowParallelLinear

#: the smallest CUDA compute capability with float8 matmuls (Ada Lovelace 8.9, Hopper 9.0, Blackwell 10.x)
MIN_CAPABILITY = (8, 9)


def check_float8_device(
    device_type: str, capability: tuple[int, int] | None = None, name: str = ""
) -> bool:
    """Whether float8 runs emulated (a CPU) or on the hardware (a CUDA GPU of compute capability >= 8.9).

    Raises:
        ConfigError: a GPU below compute capability 8.9 (naming it), or another device type.
    """
    if device_type == "cpu":
        return True
    if device_type != "cuda":
        raise ConfigError(
            f"fp8.enabled: float8 training runs on CUDA GPUs (or emulated on a CPU), not on "
            f"{device_type!r}; set fp8.enabled false"
        )
    if capability is not None and tuple(capability) < MIN_CAPABILITY:
        raise ConfigError(
            f"fp8.enabled: {name or 'this GPU'} (compute capability {capability[0]}.{capability[1]}) "
            "has no float8 matmuls; float8 training needs compute capability 8.9 or higher (Ada, "
            "Hopper, Blackwell): set fp8.enabled false"
        )
    return False


def torchao_config(recipe: str, emulate: bool):
    """torchao's ``Float8LinearConfig`` of ``recipe`` ("tensorwise", "rowwise", "rowwise_with_gw_hp"),
    emulated (float32 matmuls of the float8 values) when ``emulate``."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)


def excluded(name: str, patterns) -> str | None:
    """The first pattern of ``patterns`` matching module ``name`` or a module containing it (``fnmatch``, at any
    depth: "lm_head" matches "lm_head" and "model.lm_head"), or None."""
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        if any(fnmatchcase(p, pattern) or fnmatchcase(p, "*." + pattern) for p in prefixes):
            return pattern
    return None


def convert_to_float8(
    module: nn.Module,
    fp8: FP8Config,
    device: torch.device,
    *,
    capability=None,
    device_name: str = "",
) -> dict:
    """Swap ``module``'s linear layers for float8 ones in place (see the module docstring).

    Args:
        module: a plait model, a ``ModuleList`` of pipeline chunks, or a Hugging Face model.
        fp8: the ``fp8`` section (recipe, exclude patterns).
        device: where the model computes; a CPU runs torchao's emulation.
        capability, device_name: the GPU's compute capability and name (default: read from ``device``).

    Returns:
        ``{"converted": names, "excluded": names, "unaligned": names}`` of the linear layers, and
        ``"experts"``: the MoE layers' ``float8_moe.ExpertsReport``.

    Raises:
        ConfigError: a GPU without float8 (``check_float8_device``), or torchao not installed.
    """
    if device.type == "cuda" and capability is None:
        capability, device_name = (
            torch.cuda.get_device_capability(device),
            torch.cuda.get_device_name(device),
        )
    emulate = check_float8_device(device.type, capability, device_name)
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError as err:
        raise ConfigError(
            f"fp8.enabled needs torchao's float8 training (pip install 'torchao>=0.18'): {err}"
        ) from None
    config = torchao_config(fp8.recipe, emulate)
    from torchao.float8.float8_linear import Float8Linear

    from plait.precision.float8_layers import Float8ColumnParallelLinear, Float8RowParallelLinear
    from plait.precision.float8_moe import convert_moe_experts

    plait_layers = {
        ColumnParallelLinear: Float8ColumnParallelLinear,
        RowParallelLinear: Float8RowParallelLinear,
    }
    wanted = _Selection(fp8.exclude, (Float8Linear, *plait_layers.values()))
    for name, child in list(module.named_modules()):
        for attr, sub in list(child.named_children()):
            full = f"{name}.{attr}" if name else attr
            if type(sub) in plait_layers and wanted(sub, full):
                setattr(child, attr, plait_layers[type(sub)](sub, config))
    convert_to_float8_training(
        module,
        config=config,
        module_filter_fn=lambda m, fqn: type(m) is nn.Linear and wanted(m, fqn),
    )
    experts = convert_moe_experts(module, fp8, device.type, capability, device_name)
    wanted.matched |= experts.matched
    _log(fp8, wanted.report, emulate, wanted.matched)
    return {**wanted.report, "experts": experts}


class _Selection:
    """Which linear layers convert (called as ``selection(module, name)``): not one converted already, not one
    an ``fp8.exclude`` pattern names, only weights whose dimensions are multiples of 16. ``report`` lists each
    layer's verdict by kind; ``matched`` the exclude patterns that named one."""

    def __init__(self, exclude: list[str], converted_types: tuple[type, ...]):
        self.exclude, self.converted_types = exclude, converted_types
        self.report: dict[str, list[str]] = {"converted": [], "excluded": [], "unaligned": []}
        self.matched: set[str] = set()

    def __call__(self, m: nn.Module, name: str) -> bool:
        if isinstance(m, self.converted_types):
            return False
        pattern = excluded(name, self.exclude)
        if pattern is not None:
            self.matched.add(pattern)
            self.report["excluded"].append(name)
            return False
        if any(n % 16 for n in m.weight.shape):
            self.report["unaligned"].append(name)
            return False
        self.report["converted"].append(name)
        return True


def _log(fp8: FP8Config, report: dict, emulate: bool, matched: set) -> None:
    """One summary line (rank 0); a warning for each exclude pattern that matched no linear layer."""
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    log = logging.getLogger("plait")
    where = (
        "emulated on the CPU (torchao's float32 matmuls of float8 values: numerics, not speed)"
        if emulate
        else "on the GPU's float8 matmuls"
    )
    log.warning(
        "fp8: %d linear layer(s) compute in float8 (torchao recipe %r), %s; %d excluded by fp8.exclude, %d "
        "left in high precision because a weight dimension is not a multiple of 16%s",
        len(report["converted"]),
        fp8.recipe,
        where,
        len(report["excluded"]),
        len(report["unaligned"]),
        f" ({', '.join(report['unaligned'][:4])}...)" if report["unaligned"] else "",
    )
    for pattern in fp8.exclude:
        if pattern not in matched and pattern not in DEFAULT_EXCLUDE:
            log.warning(
                "fp8.exclude pattern %r matches no linear layer of this model (or this pipeline stage); "
                "module names look like %r",
                pattern,
                (report["converted"] or ["?"])[0],
            )
