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

    Raises:
        ConfigError: an unknown recipe (naming the valid ones), an empty or non-string exclude pattern.
    """

    enabled: bool = False
    recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"] = "tensorwise"
    exclude: list[str] = field(default_factory=lambda: list(DEFAULT_EXCLUDE))

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
