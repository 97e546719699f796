"""``deepspeed.zero`` on plait: ``GatheredParameters`` (whole parameters for a moment, edits kept with
``modifier_rank``) and ``Init`` (accepted; the model is partitioned in ``initialize``)."""

from __future__ import annotations

import logging
from contextlib import ExitStack, nullcontext

import torch
import torch.distributed as dist

from plait.zero.edits import owner_of

log = logging.getLogger("plait")


class GatheredParameters:
    """Context manager: inside it, the given parameters (and, in plait, all others of their engine) are
    whole on every rank; on exit, when ``modifier_rank`` (a global rank) is given, that rank's values
    become every rank's parameters, fp32 master weights included. Collective over the data-parallel ranks.

    Args (DeepSpeed's): ``params``: a parameter or an iterable of them (parameters no engine trains,
    or ``enabled=False``: a no-op); ``modifier_rank``: the rank whose edits are kept, or None (edits are
    not kept); ``fwd_module``: accepted for compatibility (plait registers no external parameters).

    Raises:
        ValueError: the parameters belong to two engines, or ``modifier_rank`` is not in their
            data-parallel group.
    """

    def __init__(
        self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True
    ):
        params = [params] if isinstance(params, torch.Tensor) else list(params or [])
        owners = {id(o): o for o in (owner_of(p) for p in params) if o is not None}
        if len(owners) > 1:
            raise ValueError(
                "GatheredParameters got parameters of two plait engines; gather each engine's apart"
            )
        self._ctx = nullcontext()
        if enabled and owners:
            opt = next(iter(owners.values()))
            self._ctx = opt.gathered_parameters(_dp_rank(opt, modifier_rank))
        self._stack = ExitStack()

    def __enter__(self):
        self._stack.enter_context(self._ctx)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


def _dp_rank(opt, modifier_rank: int | None) -> int | None:
    if modifier_rank is None or opt.dp_group is None or not dist.is_initialized():
        return modifier_rank
    ranks = dist.get_process_group_ranks(opt.dp_group)
    if modifier_rank not in ranks:
        raise ValueError(
            f"modifier_rank {modifier_rank} is not in this rank's data-parallel group {ranks}"
        )
    return ranks.index(modifier_rank)


class Init:
    """``deepspeed.zero.Init`` on plait: accepted, with a one-line notice. DeepSpeed partitions each
    parameter as it is created; here the model built inside is whole and ``initialize`` partitions it
    (ZeRO-3), so training is the same and only the peak host memory during construction differs. To build a
    model without its weights, use ``plait.zero.meta_parameters()`` and pass the checkpoint folder to
    ``plait.initialize(..., weights=...)``: each rank then reads only its shard (``plait.zero.weights``)."""

    def __init__(self, *args, enabled: bool = True, **kwargs):
        self.enabled = enabled

    def __enter__(self):
        if self.enabled:
            log.warning(
                "zero.Init: the model is built whole and partitioned in initialize(); to build it "
                "without weights use plait.zero.meta_parameters() and plait.initialize(..., weights=path)"
            )
        return self

    def __exit__(self, *exc):
        return False
