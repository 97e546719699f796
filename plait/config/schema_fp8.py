"""``fp8`` section (plait): float8 training through torchao's float8 recipes (``plait.precision.float8``).

Part of the config schema (:mod:`plait.config.schema` re-exports every name here); field metadata as
described there. float8 is a compute format only: parameters, master weights, gradients and checkpoints
keep their dtypes (bf16/fp32), each converted linear layer casts its matmul operands to float8 on the fly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from plait.config.schema_base import ConfigError

#: torchao's names of its float8 training recipes (``torchao.float8.Float8LinearRecipeName``)
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
#: modules left in high precision by default: Hugging Face models' output head (plait's own ``LMHead``
#: is never converted)
DEFAULT_EXCLUDE = ("lm_head",)


@dataclass(frozen=True)
class FP8Config:
    """``fp8``: float8 matmuls in the linear layers (Micikevicius et al., "FP8 Formats for Deep Learning", 2022;
    torchao's float8 training).

    ``enabled``: convert plait's Column/RowParallelLinear (fused projections included) and a Hugging Face
    model's ``nn.Linear`` layers when the engine is built. ``recipe``: torchao's recipe name, "tensorwise"
    (one dynamic scale per tensor), "rowwise" (a scale per row, powers of two) or "rowwise_with_gw_hp" (rowwise,
    the weight gradient in high precision); with tensor_parallel.size > 1 only "tensorwise" (as torchao's
    float8 tensor parallelism). ``exclude``: module-name patterns (``fnmatch``; a pattern matches a module or
    any module inside it, at any depth: "lm_head", "model.layers.0", "layers.1.*") left in high precision.
    ``float8_all_gather`` (torchao's ``enable_fsdp_float8_all_gather``): ZeRO-3 casts each float8 layer's
    weight shard to float8 before the all-gather (one byte an element instead of two for bf16), with one
    tensorwise scale per whole weight, and the layer computes with the gathered float8 weight
    (``plait.precision.float8_gather``); tensorwise recipe and ZeRO stage 3 only. Off by default, as torchao's.

    Raises:
        ConfigError: an unknown recipe (naming the valid ones), an empty or non-string exclude pattern,
            ``float8_all_gather`` without fp8 or with a rowwise recipe.
    """

    enabled: bool = False
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    exclude: list[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDE))
    float8_all_gather: bool = False

    def __post_init__(self) -> None:
        if self.recipe not in FP8_RECIPES:
            raise ConfigError(
                f"fp8.recipe = {self.recipe!r} is not a torchao float8 recipe; use one of "
                f"{', '.join(FP8_RECIPES)}"
            )
        bad = [p for p in self.exclude if not isinstance(p, str) or not p.strip()]
        if bad:
            raise ConfigError(
                f"fp8.exclude holds {bad!r}: each entry must be a non-empty module-name pattern such "
                'as "lm_head" or "model.layers.0"'
            )
        if self.float8_all_gather and not (self.enabled and self.recipe == "tensorwise"):
            raise ConfigError(
                f"fp8.float8_all_gather gathers weights cast with one tensorwise scale each, but fp8 is "
                f"{'enabled with recipe ' + repr(self.recipe) if self.enabled else 'not enabled'}: set "
                'fp8.enabled true with fp8.recipe "tensorwise", or fp8.float8_all_gather false'
            )

    def check_parallel(self, zero_stage: int, tensor_parallel: int) -> None:
        """``float8_all_gather`` needs ZeRO stage 3 (parameters gathered at all) and tensor_parallel.size 1.

        Raises:
            ConfigError: naming the stage or size and the fix.
        """
        if not self.float8_all_gather:
            return
        if zero_stage != 3:
            raise ConfigError(
                f"fp8.float8_all_gather casts ZeRO-3's parameter shards before their all-gather, but "
                f"zero_optimization.stage is {zero_stage}: set zero_optimization.stage 3 or "
                "fp8.float8_all_gather false"
            )
        if tensor_parallel > 1:
            raise ConfigError(
                f"fp8.float8_all_gather with tensor_parallel.size {tensor_parallel}: not built (the "
                "scale would span the tp group too); set tensor_parallel.size 1 or "
                "fp8.float8_all_gather false"
            )
