"""Regional compilation: ``torch.compile`` of each transformer block, the engine's ZeRO machinery outside.

Each block's ``forward`` is replaced by its compiled version (a method bound to the block), so module hooks
(ZeRO-3, ZeRO-Offload) still run eagerly around it and parameter names (checkpoints) do not change; all
blocks share one compiled graph (torchtitan's ``apply_compile``; Ansel et al., "PyTorch 2", ASPLOS'24).
Activation checkpointing stays outside the region. Pickling a whole compiled model is not supported (save
its ``state_dict``). Regions are traced with dynamo's ``nested_graph_breaks``, scoped to their calls.
Why per block, what still breaks a block's graph and what that costs: ``docs/engine.md``.
"""

from __future__ import annotations

import functools
import logging
import types

import torch
from torch import nn

from plait.config import ConfigError

#: attribute marking a module whose ``forward`` this module compiled
COMPILED_ATTR = "_plait_compiled_forward"


def compile_targets(module: nn.Module) -> list[nn.Module]:
    """The regions to compile: plait's ``TransformerBlock`` and ``LMHead`` modules (the head with its
    loss: inductor fuses the float32 softmax passes); for Hugging Face models the modules whose class is
    named in ``_no_split_modules`` (the decoder layers); otherwise the module itself."""
    from plait.layers.block import TransformerBlock
    from plait.layers.ends import LMHead

    blocks = [m for m in module.modules() if isinstance(m, (TransformerBlock, LMHead))]
    if blocks:
        return blocks
    names = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    blocks = [m for m in module.modules() if type(m).__name__ in names]
    return blocks or [module]


def compile_regions(
    module: nn.Module, backend: str = "inductor", kwargs: dict | None = None
) -> list[nn.Module]:
    """Compile the ``forward`` of each region of ``module`` (``compile_targets``) in place; regions
    already compiled are left alone. Returns the regions compiled now.

    Args:
        backend: a ``torch.compile`` backend name ("inductor", "aot_eager", "eager", ...) or callable.
        kwargs: other ``torch.compile`` arguments (``mode``, ``fullgraph``, ``dynamic``, ``options``).

    Raises:
        ValueError: ``kwargs`` holds ``backend`` (pass it as ``backend``).
    """
    kwargs = dict(kwargs or {})
    if "backend" in kwargs:
        raise ValueError("compile kwargs must not hold 'backend'; pass backend= instead")
    done, compiled = [], {}  # one compiled function per region class, bound to each region
    for region in compile_targets(module):
        if getattr(region, COMPILED_ATTR, False):
            continue
        cls = type(region)
        if cls not in compiled:
            compiled[cls] = _resuming_nested_breaks(
                torch.compile(cls.forward, backend=backend, **kwargs)
            )
        # a bound method: copy.deepcopy rebinds it to the copy (a closure over the region would not)
        region.forward = types.MethodType(compiled[cls], region)
        setattr(region, COMPILED_ATTR, backend)
        done.append(region)
    if done:
        logging.getLogger("plait").info(
            "compile: %d region(s) of %s compiled with backend %r",
            len(done),
            type(done[0]).__name__,
            backend,
        )
    return done


def _resuming_nested_breaks(fn):
    """``fn`` (a ``torch.compile`` result) traced with dynamo's ``nested_graph_breaks`` during its own calls
    only; unchanged on a torch without that option."""
    if not hasattr(torch._dynamo.config, "nested_graph_breaks"):
        return fn

    def run(*args, **kwargs):
        with torch._dynamo.config.patch(nested_graph_breaks=True):
            return fn(*args, **kwargs)

    # name and docstring only: copying fn's __dict__ would copy dynamo's markers, and an outer compile would
    # then inline fn past the patch
    return functools.update_wrapper(run, fn, updated=())


def compiled_backend(module: nn.Module):
    """The backend ``compile_regions`` compiled ``module``'s regions with, or None."""
    return next(
        (getattr(m, COMPILED_ATTR) for m in module.modules() if getattr(m, COMPILED_ATTR, False)),
        None,
    )


def is_compiled(module: nn.Module) -> bool:
    """Whether ``compile_regions`` compiled any region of ``module``."""
    return compiled_backend(module) is not None


def compile_engine_model(
    module: nn.Module,
    pipeline,
    backend: str,
    compile_kwargs: dict | None,
    schedule,
    compiled_autograd_enabled: bool,
    deepcompile: bool,
) -> None:
    """``Engine.compile``: refuse what it does not serve, warn about what it does differently, then
    ``compile_regions``.

    Raises:
        ValueError: a DeepCompile ``schedule`` or ``compiled_autograd_enabled`` (not implemented: the
            backward of each compiled block is compiled already), or ``backend`` inside ``compile_kwargs``.
        ConfigError: a zero-bubble pipeline schedule (its split backward cannot split a compiled block).
    """
    if schedule is not None or compiled_autograd_enabled:
        raise ValueError(
            "engine.compile: DeepCompile schedules and compiled autograd are not implemented; "
            "call engine.compile(backend, compile_kwargs) without them"
        )
    if pipeline is not None and str(pipeline.schedule).startswith("zb"):
        raise ConfigError(
            f"compile with pipeline schedule {pipeline.schedule!r}: a compiled block "
            "is one autograd node, which the zero-bubble split would run whole in both its "
            "input- and weight-gradient passes; use schedule '1f1b' or 'interleaved', or "
            "compile off"
        )
    before = compiled_backend(module)
    if before is not None and before != backend:
        logging.getLogger("plait").warning(
            "engine.compile: the model is compiled with backend %r already; "
            "backend %r is not applied",
            before,
            backend,
        )
    if deepcompile:
        logging.getLogger("plait").warning(
            "config: compile.deepcompile = true is accepted: plait compiles each transformer block with "
            "torch.compile (its ZeRO hooks stay outside the compiled regions) instead of DeepCompile's passes"
        )
    compile_regions(module, backend, compile_kwargs)
