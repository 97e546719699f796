"""ZeRO stage 3: parameters sharded over dp, gathered per module unit just in time (ZeRO, Rajbhandari et
al., SC'20, Sec. 5.3, P_os+g+p).

``ParamGatherer`` keeps each rank's ``1/dp`` slice of every parameter (``Segment.local``); a *unit*'s
parameters are all-gathered into a per-segment ``[padded]`` buffer right before its forward, released
after (``reshard_after_forward``), gathered again for its backward and released once its gradients
are in (``stage12.GradReducer`` reduce-scatters them). Units are every module with direct parameters,
or the modules listed in ``units=[...]``; parameters under ``param_persistence_threshold`` stay whole.
Later passes prefetch the recorded unit order up to ``prefetch_bucket_size`` elements; the split
backward of zero-bubble pipelines keeps *weight holds* from BI to BW.

Limits (not detected): a parameter read outside the forward of every unit holding it is empty there;
a unit whose outputs are not tensors cannot re-gather for backward. Units, buffers, prefetch, split
backward in detail: ``docs/zero.md``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from plait.zero.comm import Comms, Pending, gather_segments
from plait.zero.flat import Segment
from plait.zero.gather_cast import forget, land, narrows, sources
from plait.zero.stage3_units import Unit, UnitOrder, accumulates, ahead


class ParamGatherer:
    """Forward/backward hooks that all-gather and release stage-3 parameters per unit.

    Args:
        root: the model (hooks go on its units and on it).
        units: from ``build_units``; each unit's ``segments`` must be filled in by the caller.
        comms: the groups each segment is sharded over (``plait.zero.comm.Comms``).
        allgather_bucket_size: elements per coalesced all-gather.
        prefetch_bucket_size: elements fetched ahead of use, in whole units (0: no prefetch).
        reshard_after_forward: release each unit when its forward ends (``docs/zero.md``); False keeps
            it gathered until its backward has produced every gradient.
        on_backward: called from every backward hook (the optimizer queues its end-of-backward work).
        gate: ZeRO-Offload's ``plait.zero.offload.ready.Readiness`` (None otherwise): ``gather`` first
            calls ``gate.wait_for(segments)`` so a host optimizer step still in flight has written them,
            and prefetch takes only segments for which ``gate.consumed(seg)`` holds.
        cast: a ``plait.zero.gather_cast.GatherCast`` (None: none): the hooks' gathers of its segments
            (``GroupKey.cast``) over more than one rank send what ``cast.narrow`` makes of the shards.
    """

    def __init__(
        self,
        root: nn.Module,
        units: list[Unit],
        comms: Comms,
        allgather_bucket_size: int,
        prefetch_bucket_size: int,
        on_backward: Callable[[], None],
        gate=None,
        reshard_after_forward: bool = True,
        device: torch.device | None = None,
        cast=None,
    ):
        self.root, self.units, self.cast = root, units, cast
        self.reshard_after_forward = reshard_after_forward
        self.device = device  # where gathered buffers live (None: beside each shard)
        self.buffers: dict[int, torch.Tensor] = {}  # id(segment) -> its [padded] gather buffer
        self.comms, self.on_backward = comms, on_backward
        self.allgather_bucket_size, self.prefetch_bucket_size = (
            allgather_bucket_size,
            prefetch_bucket_size,
        )
        self.refs: dict[int, int] = {}
        self.in_flight: dict[int, tuple[Pending, list[Segment], list[torch.Tensor]]] = {}
        self.units_of: dict[int, list[Unit]] = {}
        for u in units:
            for p in u.params:
                self.units_of.setdefault(id(p), []).append(u)
        self.params = list({id(p): p for u in units for p in u.params}.values())
        self.task = (-1, False)  # (autograd graph task, whether it computes input gradients only)
        self.input_pass: tuple[int, set[int]] = (
            -1,
            set(),
        )  # (that task, units it held for their weight pass)
        self.hold_groups: list[
            set[int]
        ] = []  # per input pass whose weight pass is to come: the units it held
        self.fwd, self.bwd, self.gate = UnitOrder(), UnitOrder(), gate
        self.stats = {
            "fetched": 0,
            "prefetched": 0,
            "prefetched_in_backward": 0,
        }  # segments gathered
        self.handles = [
            root.register_forward_pre_hook(self._root_pre_forward, prepend=True),
            root.register_forward_hook(self._root_post_forward, always_call=True),
        ]
        for u in units:
            self.handles.append(u.module.register_forward_pre_hook(self._make_pre(u)))
            self.handles.append(
                u.module.register_forward_hook(self._make_post(u), always_call=True)
            )
        self._reset_counts()

    # ---- gather / release ----------------------------------------------------------------
    def _segments(self) -> list[Segment]:
        seen, out = set(), []
        for u in self.units:
            for seg in u.segments:
                if id(seg) not in seen:
                    seen.add(id(seg))
                    out.append(seg)
        return out

    def _buffer(self, seg: Segment, narrow: bool = False) -> torch.Tensor:
        """``seg``'s ``[padded]`` gather buffer with its storage allocated (the shard itself on one rank);
        ``narrow``: the uint8 one of ``cast``."""
        device = self.device if self.device is not None else seg.local.device
        if self.comms.of(seg).size == 1 and seg.local.device == device:
            return seg.local  # filled by _sources: the gather is the shard itself
        buf, dtype = self.buffers.get(id(seg)), torch.uint8 if narrow else seg.local.dtype
        if buf is None or buf.dtype != dtype:
            buf = self.buffers[id(seg)] = torch.empty(seg.padded, dtype=dtype, device=device)
        elif buf.untyped_storage().nbytes() == 0:
            buf.untyped_storage().resize_(buf.numel() * buf.element_size())
        return buf

    def _drop(self, seg: Segment) -> None:
        """Release ``seg``: parameters empty, its gather buffer's storage (and every view of it) freed. A
        buffer whose storage was handed to numpy (``Tensor.numpy()`` makes it fixed-size: a checkpoint
        write) is dropped instead, and the next gather makes a new one."""
        forget(self.cast, seg)
        seg.free()
        buf = self.buffers.get(id(seg))
        if buf is None:
            seg.drop_shard()  # one rank: the shard was the buffer
            return
        if buf.untyped_storage().resizable():
            buf.untyped_storage().resize_(0)
        else:
            del self.buffers[id(seg)]

    def _sources(self, segs: list[Segment]) -> list[torch.Tensor]:
        """The shards the all-gather reads (on the device of the buffers); ``_gathered`` gives back those
        made for it."""
        return [s.shard() for s in segs]

    def _gathered(self, segs: list[Segment], outs: list[torch.Tensor]) -> None:
        """The all-gather into ``outs`` is complete: point the parameters there, give back derived shards."""
        for s, out in zip(segs, outs):
            land(self.cast, s, out)
            if out is not s.local:
                s.drop_shard()

    def _fetch(self, segs: list[Segment], async_op: bool, narrow: bool = True) -> None:
        if not segs:
            return
        self.stats["prefetched" if async_op else "fetched"] += len(segs)
        if async_op and torch._C._current_graph_task_id() != -1:
            self.stats["prefetched_in_backward"] += len(segs)
        for comm, part in self.comms.split(segs):
            flags = narrows(self.cast if narrow else None, part, comm.size)
            outs = [self._buffer(s, f) for s, f in zip(part, flags)]
            ins = sources(self.cast, part, self._sources(part), flags, comm.group)
            launched = gather_segments(
                outs, ins, comm.group, comm.size, self.allgather_bucket_size, async_op=async_op
            )
            if not async_op or not launched:
                self._gathered(part, outs)
                continue
            for pending, run in launched:
                pending.keep.extend(ins[k] for k in run)
                record = (pending, [part[k] for k in run], [outs[k] for k in run])
                for k in run:
                    self.in_flight[id(part[k])] = record

    def _land(self, seg: Segment) -> None:
        record = self.in_flight.get(id(seg))
        if record is None:
            return
        pending, segs, outs = record
        pending.wait()
        for s in segs:
            self.in_flight.pop(id(s), None)
        self._gathered(segs, outs)

    def gather(self, u: Unit, narrow: bool = True) -> None:
        """Make ``u``'s parameters whole (synchronous for what was not prefetched; ``narrow``: through
        ``cast`` where it applies). Collective."""
        if u.gathered:
            return
        u.gathered = True
        if self.gate is not None:
            self.gate.wait_for(u.segments)
        need = []
        for seg in u.segments:
            self.refs[id(seg)] = self.refs.get(id(seg), 0) + 1
            if seg.full is None and id(seg) not in self.in_flight:
                need.append(seg)
        self._fetch(need, async_op=False, narrow=narrow)
        for seg in u.segments:
            self._land(seg)

    def release(self, u: Unit) -> None:
        """Drop ``u``'s hold on its segments; a segment no unit holds goes back to its shard."""
        if not u.gathered:
            return
        u.gathered = False
        for seg in u.segments:
            self.refs[id(seg)] -= 1
            if self.refs[id(seg)] == 0 and id(seg) not in self.in_flight:
                self._drop(seg)

    def _prefetch(self, upcoming: list[int]) -> None:
        """All-gather ahead what the bound takes of ``upcoming`` (``stage3_units.ahead``)."""
        if self.prefetch_bucket_size > 0:
            self._fetch(
                [
                    seg
                    for seg in ahead(self.units, upcoming, self.prefetch_bucket_size)
                    if seg.full is None
                    and id(seg) not in self.in_flight
                    and (self.gate is None or self.gate.consumed(seg))
                ],
                async_op=True,
            )

    def _free_unheld(self) -> None:
        for seg in list(self._segments()):
            self._land(seg)
        for seg in self._segments():
            if self.refs.get(id(seg), 0) == 0 and seg.full is not None:
                self._drop(seg)

    # ---- hooks ------------------------------------------------------------------------------
    def _root_pre_forward(self, module, args):
        self.fwd.start()

    def _root_post_forward(self, module, args, output):
        self.fwd.stop_recording()
        self._free_unheld()
        if torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            self._prefetch(
                self.bwd.order
            )  # the backward's first units, while the forward's tail runs

    def _make_pre(self, u: Unit):
        def pre_forward(module, args):
            if (
                torch._C._current_graph_task_id() != -1
            ):  # recomputed in backward: its backward is next
                self._pre_backward(
                    u
                )  # (reentrant checkpointing recomputes before the output hooks fire)
                return
            self.gather(u)
            self._prefetch(self.fwd.advance(u.index))

        return pre_forward

    def _keeps_after_forward(self, u: Unit) -> bool:
        """Whether ``u`` stays gathered when its forward ends (``docs/zero.md``, "Reshard after forward")."""
        if torch._C._current_graph_task_id() != -1:
            return True  # recomputed inside backward: the unit's backward comes next
        if not torch.is_grad_enabled():
            return False
        return not self.reshard_after_forward or u.module is self.root

    def _make_post(self, u: Unit):
        def post_forward(module, args, output):
            hooked, held = (
                False,
                [False],
            )  # ``held``: this forward's hold for a weight-gradient pass is taken
            if torch.is_grad_enabled():
                for t in tree_flatten(output)[0]:
                    if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_leaf:
                        t.register_hook(lambda grad, u=u, held=held: self._pre_backward(u, held))
                        hooked = True
            # no output to re-gather from (a custom object, a leaf, a side loss): keep it until its gradients
            if not self._keeps_after_forward(u) and (hooked or not torch.is_grad_enabled()):
                self.release(u)

        return post_forward

    def _pre_backward(self, u: Unit, held: list[bool] | None = None) -> None:
        if self._input_only(u):
            self._hold_for_weights(u, held)
            return
        self.on_backward()
        if u.gathered:
            return
        self.gather(u)
        self._prefetch(self.bwd.advance(u.index))

    # ---- zero-bubble split backward (docs/zero.md, "Split backward") -------------------------------------
    def _input_only(self, u: Unit) -> bool:
        """Whether the running backward accumulates no gradient into this gatherer's parameters (a zero-bubble
        BI); decided once per autograd graph task, from the first unit it reaches."""
        task = torch._C._current_graph_task_id()
        if self.task[0] != task:
            self.task = (task, not accumulates(u.params + self.params))
        return self.task[1]

    def _hold_for_weights(self, u: Unit, held: list[bool] | None) -> None:
        """In an input-gradient pass: gather ``u`` (its backward needs it now) and, once per pass and per
        forward, hold it for the weight pass to come (``held``: a node re-run alone in BW fires the output
        hook of its forward again: no second hold). The pass's end lets go of its gathers, not of the holds."""
        if self.input_pass[0] != self.task[0]:
            self.input_pass = (self.task[0], set())
            self.hold_groups.append(self.input_pass[1])
            torch.autograd.Variable._execution_engine.queue_callback(self._end_input_pass)
        fresh = held is None or not held[0]
        if held is not None:
            held[0] = True
        if not u.gathered:
            self.gather(u)
            self._prefetch(self.bwd.advance(u.index))
        if fresh and u.index not in self.input_pass[1]:
            self.input_pass[1].add(u.index)
            u.deferred += 1
            for seg in u.segments:
                self.refs[id(seg)] += 1

    def _end_input_pass(self) -> None:
        """End of an input-gradient pass: release what it gathered; the weight holds stay."""
        self.hold_groups = [g for g in self.hold_groups if g]
        self.input_pass = (-1, set())
        self.end_backward(accumulating=False)

    def _drop_deferred(self, u: Unit, every: bool = False) -> None:
        """``u``'s weight pass has run (its gradients are in): drop one hold (``every``: all)."""
        for _ in range(u.deferred if every else min(1, u.deferred)):
            u.deferred -= 1
            for seg in u.segments:
                self.refs[id(seg)] -= 1
                if self.refs[id(seg)] == 0 and id(seg) not in self.in_flight:
                    self._drop(seg)

    def on_grad(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook body: release a unit once all its gradients are in (and drop the hold
        of the zero-bubble input-gradient pass that deferred them, if any)."""
        for u in self.units_of.get(id(param), ()):
            u.remaining -= 1
            if u.remaining == 0:
                self.release(u)
                self._drop_deferred(u)

    def end_backward(self, accumulating: bool = True) -> None:
        """End of a backward pass: release every unit, free unheld segments, re-arm counters; an accumulating
        pass closes the oldest hold group it reached (``docs/zero.md``, "Split backward")."""
        group: set[int] = set()
        if accumulating:
            reached = {u.index for u in self.units if u.remaining < len(u.params)}
            i = next((i for i, g in enumerate(self.hold_groups) if g & reached), None)
            group = self.hold_groups.pop(i) if i is not None else group
        for u in self.units:
            if u.index in group and u.remaining > 0:
                self._drop_deferred(u)
            self.release(u)
        self._free_unheld()
        self.bwd.stop_recording()
        self.bwd.start()
        self._reset_counts()

    def _reset_counts(self) -> None:
        for u in self.units:
            u.remaining = len(u.params)

    # ---- whole-model access -------------------------------------------------------------------
    def gather_all(self) -> None:
        """Gather every unit in the compute dtype (for evaluation outside hooks, export, or tests; what a hook
        or a prefetch gathered through ``cast`` and no unit holds is dropped first). Collective."""
        self._free_unheld()
        for u in self.units:
            self.gather(u, narrow=False)

    def release_all(self) -> None:
        """Release every unit. The gathered buffers are let go rather than freed in place: tensors taken
        from the whole parameters (a ``state_dict()`` inside ``gathered_parameters``) keep their values,
        and their memory goes when they do; the next gather allocates new buffers (with one rank, a derived
        shard that served as the buffer is replaced the same way)."""
        self.buffers.clear()
        for seg in self._segments():
            if seg.full is not None and seg.full is seg.local and seg.source is not None:
                seg.local = seg.local.new_empty(seg.local.shape)
                seg.drop_shard()  # one segment at a time: no second copy of the model
        for u in self.units:
            self.release(u)
            self._drop_deferred(u, every=True)
        self.hold_groups.clear()
        self._free_unheld()

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
