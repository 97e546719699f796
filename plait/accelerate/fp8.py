"""accelerate's fp8 request as the ds_config's ``fp8`` section: ``mixed_precision="fp8"`` (or
``ACCELERATE_MIXED_PRECISION=fp8``) with accelerate's torchao backend (``AORecipeKwargs``, or
``ACCELERATE_FP8_BACKEND=AO``, or no backend named: accelerate then picks torchao first).

What accelerate's DeepSpeed path does with it (read in accelerate 1.10.1 and 1.15): the ds_config's bf16 on
(``DeepSpeedPlugin.set_mixed_precision("fp8")``), and the model's ``nn.Linear`` layers swapped for torchao's
``Float8Linear`` (``convert_model_to_fp8_ao``) with the handler's ``Float8LinearConfig`` and filter before
``deepspeed.initialize``. Here: ``request`` reads the recipe at construction, ``section`` the layers left in
high precision at ``prepare`` (the model is needed), and ``write`` puts them in the ds_config's ``fp8`` section,
which plait's engine converts (``plait.precision.float8``). The mapping and what differs: ``docs/accelerate.md``.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Callable
from dataclasses import dataclass

from accelerate.utils import AORecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs
from accelerate.utils.dataclasses import FP8RecipeKwargs
from torch import nn

from plait.config import ConfigError
from plait.config.schema_fp8 import FP8_RECIPES

#: accelerate's fp8 recipe handlers (``kwargs_handlers`` entries), taken out before accelerate's own
#: ``__init__`` (plait's engine, not accelerate, converts the model)
RECIPE_HANDLERS = (AORecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs, FP8RecipeKwargs)
#: torchao ``Float8LinearConfig`` fields that are no part of the recipe's numerics (see ``recipe_of``)
NOT_THE_RECIPE = {"emulate": False, "pad_inner_dim": False, "enable_fsdp_float8_all_gather": False}
HOW = (
    "plait serves accelerate's torchao backend (AO): Accelerator(mixed_precision='fp8', "
    "kwargs_handlers=[AORecipeKwargs()]) or `accelerate launch --mixed_precision fp8 --fp8_backend ao`, "
    'or the ds_config\'s "fp8" section'
)


@dataclass(frozen=True)
class Fp8Request:
    """accelerate's fp8 request, read: torchao's ``recipe`` name, the handler's ``module_filter_func``
    (None: accelerate's default filter) and ``source`` (how it was asked, for messages)."""

    recipe: str
    module_filter_func: Callable | None
    source: str

    def section(self, model: nn.Module) -> dict:
        """The ``fp8`` section for ``model``: enabled, the recipe, and as ``exclude`` the names of the
        ``nn.Linear`` layers accelerate leaves in high precision (its default filter: the first and the
        last; a ``module_filter_func``: those it returns False for). Layers with a dimension that is not a
        multiple of 16 stay in high precision by plait's own rule, as by accelerate's default filter.

        Raises:
            ConfigError: a ``module_filter_func`` that selects such an unaligned layer (plait would not
                convert it; accelerate would, padded).
        """
        linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        if self.module_filter_func is None:
            names = [linears[0][0], linears[-1][0]] if linears else []
        else:
            keep = {n for n, m in linears if self.module_filter_func(m, n)}
            odd = [n for n, m in linears if n in keep and any(d % 16 for d in m.weight.shape)]
            if odd:
                raise ConfigError(
                    f"plait.accelerate: AORecipeKwargs' module_filter_func selects {odd[:4]}, whose weight "
                    "dimensions are not multiples of 16; plait leaves such layers in high precision: "
                    "return False for them"
                )
            names = [n for n, _ in linears if n not in keep]
        return {
            "enabled": True,
            "recipe": self.recipe,
            "exclude": [glob.escape(n) for n in dict.fromkeys(names)],
        }


def split_handlers(handlers) -> tuple[list, list]:
    """``kwargs_handlers`` as (accelerate's fp8 recipe handlers, the others)."""
    handlers = list(handlers or [])
    recipes = [h for h in handlers if isinstance(h, RECIPE_HANDLERS)]
    return recipes, [h for h in handlers if not isinstance(h, RECIPE_HANDLERS)]


def request(precision: str, handlers: list, enable_msamp: bool) -> Fp8Request | None:
    """accelerate's fp8 request (None when ``precision`` is not "fp8"), with the backend accelerate picks:
    the handler's, else ``ACCELERATE_FP8_BACKEND``, else torchao (accelerate's first choice).

    Raises:
        ConfigError: TransformerEngine or MS-AMP (handler, env, or the plugin's ``enable_msamp``), a recipe
            handler without ``mixed_precision="fp8"``, a ``Float8LinearConfig`` that is no torchao named recipe.
    """
    names = [type(h).__name__ for h in handlers]
    if precision != "fp8":
        if handlers or enable_msamp:
            raise ConfigError(
                f"plait.accelerate: {', '.join(names) or 'enable_msamp'} with mixed_precision="
                f"{precision!r}: pass mixed_precision='fp8' (float8 matmuls, bf16 elsewhere)"
            )
        return None
    env = os.environ.get("ACCELERATE_FP8_BACKEND", "NO").upper()
    unserved = [n for n in names if n != "AORecipeKwargs"]
    unserved += ["MS-AMP (DeepSpeedPlugin enable_msamp)"] if enable_msamp else []
    unserved += [f"ACCELERATE_FP8_BACKEND={env}"] if not handlers and env in ("TE", "MSAMP") else []
    if unserved:
        raise ConfigError(
            f"plait.accelerate: fp8 through {', '.join(unserved)} (TransformerEngine / MS-AMP) is not "
            f"served; {HOW}"
        )
    handler = handlers[0] if handlers else AORecipeKwargs()  # accelerate's default handler
    source = "AORecipeKwargs" if handlers else f"mixed_precision='fp8' (backend {env})"
    return Fp8Request(recipe_of(handler.config), handler.module_filter_func, source)


def recipe_of(config) -> str:
    """torchao's recipe name of a ``Float8LinearConfig`` (None: torchao's default, "tensorwise"), compared
    field by field but for ``NOT_THE_RECIPE``: ``emulate`` (plait emulates on a CPU only),
    ``pad_inner_dim`` (zero padding of a GEMM's inner dimension: the same sums) and
    ``enable_fsdp_float8_all_gather`` (FSDP2's; accelerate's DeepSpeed path does not use it).

    Raises:
        ConfigError: a config that is none of torchao's named recipes, naming the fields that differ.
    """
    if config is None:
        return "tensorwise"
    from torchao.float8 import Float8LinearConfig

    mine = dataclasses.replace(config, **NOT_THE_RECIPE)
    diffs = {}
    for name in FP8_RECIPES:
        named = dataclasses.replace(Float8LinearConfig.from_recipe_name(name), **NOT_THE_RECIPE)
        if mine == named:
            return name
        diffs[name] = [
            f"{f.name}={getattr(mine, f.name)}"
            for f in dataclasses.fields(mine)
            if getattr(mine, f.name) != getattr(named, f.name)
        ]
    near = min(diffs, key=lambda n: len(diffs[n]))
    raise ConfigError(
        f"plait.accelerate: AORecipeKwargs(config=...) is a custom Float8LinearConfig, none of torchao's "
        f"named recipes ({', '.join(FP8_RECIPES)}); it differs from {near!r} in "
        f"{'; '.join(diffs[near])}. plait's fp8 serves the named recipes only: pass "
        'Float8LinearConfig.from_recipe_name(name), or set the ds_config\'s "fp8": {"recipe": name}'
    )


def write(config: dict, section: dict, source: str) -> None:
    """Put ``section`` in the ds_config ``config`` (its other ``fp8`` keys, e.g. ``float8_all_gather``, kept).

    Raises:
        ConfigError: the ds_config has an ``fp8`` section that asks otherwise, naming both.
    """
    present = config.get("fp8")
    if present is not None:
        defaults = {"enabled": False, "recipe": "tensorwise", "exclude": ["lm_head"]}
        differ = {k: v for k, v in section.items() if present.get(k, defaults[k]) != v}
        if differ:
            raise ConfigError(
                f"plait.accelerate: the ds_config's \"fp8\" section {present} and accelerate's fp8 "
                f"request ({source}: {differ}) ask for different float8 training: drop the "
                "ds_config's fp8 section, or accelerate's fp8 (mixed_precision / AORecipeKwargs)"
            )
    config["fp8"] = {**(present or {}), **section}
