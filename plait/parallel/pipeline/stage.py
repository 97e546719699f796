"""What a pipeline stage chunk must offer ``PipelineParallel``: the contract between the pipeline and
the model side that builds the chunks (``plait.layers.stages`` for plait's models; any model can
implement it, see ``examples/compose_model.py``)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from plait.parallel.pipeline.schedules import stage_of


@runtime_checkable
class StageChunk(Protocol):
    """One model chunk of a pipeline stage (virtual stage ``stage_of(pp_rank, c, p, shape)`` for this rank's
    chunk ``c``; ``c*p + pp_rank`` in the "loop" placement).

    Attributes:
        layers: the chunk's items of the model's flat layer list, keyed by *global* index (``"0"`` the
            embedding ... ``str(L + 1)`` the head), so parameter names are the same in every layout.
        tied_across_stages: True when the model's first and last stage share a parameter (e.g. a tied
            word embedding and LM head). The same on every chunk of every rank: the pipeline builds the
            (first stage, last stage) process groups collectively when it is set.
    """

    layers: nn.ModuleDict
    tied_across_stages: bool

    def __call__(
        self, *, hidden: torch.Tensor | None = None, **batch: torch.Tensor
    ) -> torch.Tensor:
        """Run the chunk: the first stage reads ``batch["input_ids"] [b, s]`` (``hidden`` None), the others
        ``hidden`` (``activation_shape(batch)``); the last stage returns the micro-batch's scalar mean loss
        (given ``labels``), the others the activation for the next stage. ``batch["aux_loss_scale"]`` (a float,
        passed when the chunk's forward takes it: ``takes_keyword``) is d(what the backward differentiates)/d(loss),
        for the losses a chunk's layers join to the gradient themselves (``plait.layers.moe.add_loss_gradient``)."""
        ...

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The chunk's parameters under their global names (``layers.5.attn.q_proj.weight``)."""
        ...

    def activation_shape(self, batch: Mapping[str, torch.Tensor]) -> tuple[int, ...]:
        """Shape of the activation entering this chunk for ``batch`` (e.g. ``[b, s, hidden]``, or
        ``[b, s/tp, hidden]`` under sequence parallelism); evaluated per micro-batch.

        Raises:
            ValueError: the micro-batch cannot be split as the chunk needs (e.g. ``s % tp != 0``).
        """
        ...

    def tied_parameters(self) -> list[nn.Parameter]:
        """This chunk's copies of the parameters another stage also holds (the word embedding on the
        first stage, the head's copy of it on the last), in layer order; ``[]`` when it holds none or when
        one chunk holds every copy (then they are one parameter). The pipeline sums their gradients."""
        ...


def missing_members(chunk: object) -> list[str]:
    """The ``StageChunk`` members ``chunk`` lacks (``[]`` when it offers them all)."""
    names = (
        "layers",
        "tied_across_stages",
        "named_parameters",
        "activation_shape",
        "tied_parameters",
    )
    return [n for n in names if not hasattr(chunk, n)]


def check_stage_modules(stage_modules: list, virtual_stages: int | None) -> None:
    """Raises ValueError (no module, or not ``virtual_stages`` of them) or TypeError (a module that is not a
    ``StageChunk``), naming the fix."""
    v = len(stage_modules)
    if virtual_stages is not None and virtual_stages != v:
        raise ValueError(
            f"virtual_stages={virtual_stages} but {v} stage modules were given; build "
            f"them with build_stage_modules(config, mesh, v={virtual_stages})"
        )
    if v < 1:
        raise ValueError("PipelineParallel needs at least one stage module")
    for c, chunk in enumerate(stage_modules):
        if missing := missing_members(chunk):
            raise TypeError(
                f"stage module {c} ({type(chunk).__name__}) is not a StageChunk: it lacks "
                f"{missing} (see plait.parallel.pipeline.stage; plait.layers.stages builds plait's)"
            )


def takes_keyword(module, name: str) -> bool:
    """Whether ``module``'s forward accepts keyword argument ``name`` (by name or through ``**kwargs``)."""
    params = inspect.signature(module.forward).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def check_layer_order(chunks: list, p: int, rank: int, shape: str, group=None) -> None:
    """Refuse chunks whose layers do not follow one another along the virtual stages: stage ``s``'s last
    global layer index plus one must be stage ``s+1``'s first (chunks built for another placement, e.g.
    "loop" chunks run by "zb-v", fail here). Collective over the pipeline ``group`` when p > 1.

    Raises:
        ValueError: naming the two stages, their layers and the fix.
    """
    mine = [
        (stage_of(rank, c, p, shape), min(map(int, chunk.layers)), max(map(int, chunk.layers)))
        for c, chunk in enumerate(chunks)
        if len(chunk.layers)
    ]
    spans = [mine]
    if p > 1:
        spans = [None] * p
        dist.all_gather_object(spans, mine, group=group)
    ordered = sorted(span for rank_spans in spans for span in rank_spans)
    for (s, _, end), (t, start, _) in zip(ordered, ordered[1:]):
        if start != end + 1:
            raise ValueError(
                f"pipeline stage {s} ends at layer {end} but stage {t} starts at layer {start} "
                f"(placement {shape!r}); build the chunks for this schedule: "
                f"build_stage_modules(config, mesh, v, schedule=<the pipeline's schedule>)"
            )
