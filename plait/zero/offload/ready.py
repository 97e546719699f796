"""Per-segment readiness of an offloaded optimizer step that is still running when ``step()`` returns.

``HostStepper.apply`` queues each segment's host step, in forward order, and returns; each segment has a
*ticket* (a ``Future`` of the CUDA event recorded after its copy back to the device; None on a CPU-only
machine). ``Readiness`` hands the segments to the device on the main thread::

    ready.start(tickets)            # step(): tickets[k] belongs to order[k]
    ready.through(k)                # a forward pre-hook needs order[k]: wait for tickets[:k+1]
    ready.wait_all()                # anything that reads parameters or optimizer state

``through(k)`` makes the current stream wait on the copy events and, where dp ranks hold parameters
whole, all-gathers the updated shards it consumed; consumption happens only at module hooks that fire
in the same order on every rank, so collectives match. ``forward_order`` gives the segment order.
Design: ``docs/offload.md``.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from plait.zero.comm import publish_segments
from plait.zero.flat import Segment


class Readiness:
    """Hands updated segments to the device in ``order`` (module docstring).

    Args:
        order: every segment, in the order the worker steps them (forward order).
        device: the module's device. comms: the groups segments are sharded over (``plait.zero.comm.Comms``).
        allgather_bucket_size: elements per coalesced all-gather. overlap_comm: asynchronous all-gathers.
    """

    def __init__(
        self,
        order: list[Segment],
        device: torch.device,
        comms,
        allgather_bucket_size: int,
        overlap_comm: bool,
    ):
        self.order = order
        self.pos = {id(s): k for k, s in enumerate(order)}
        self.device, self.cuda = device, device.type == "cuda"
        self.comms = comms
        self.allgather_bucket_size, self.overlap_comm = allgather_bucket_size, overlap_comm
        self.tickets: list | None = None
        self.next = 0
        self.stats = {"steps": 0, "segments_in_flight": 0, "waits": 0}

    @property
    def active(self) -> bool:
        """True while some segment of the last step has not been handed to the device."""
        return self.tickets is not None

    def start(self, tickets: list) -> None:
        """A step was queued: ``tickets[k]`` (Future, event or None) belongs to ``order[k]``."""
        if self.tickets is not None:
            raise RuntimeError(
                "an offloaded step is still in flight; wait_all() before starting another"
            )
        if len(tickets) != len(self.order):
            raise ValueError(f"{len(tickets)} tickets for {len(self.order)} segments")
        self.tickets, self.next = tickets, 0
        self.stats["steps"] += 1
        self.stats["segments_in_flight"] += sum(
            isinstance(t, Future) and not t.done() for t in tickets
        )

    def consumed(self, seg: Segment) -> bool:
        """True when ``seg`` may be read on the device now (no step in flight, or already handed out)."""
        return self.tickets is None or self.pos[id(seg)] < self.next

    def wait_for(self, segs) -> None:
        """Hand out every segment up to the last of ``segs`` in ``order``."""
        k = max((self.pos[id(s)] for s in segs), default=-1)
        self.through(k)

    def wait_all(self) -> None:
        self.through(len(self.order) - 1)

    def through(self, k: int) -> None:
        """Main thread: make ``order[:k+1]`` usable on the current stream (module docstring). Collective
        over dp when it all-gathers; re-raises an error the worker hit."""
        if self.tickets is None or k < self.next:
            return
        self.stats["waits"] += 1
        consumed = []
        stream = torch.cuda.current_stream(self.device) if self.cuda else None
        try:
            while self.next <= k:
                seg, ticket = self.order[self.next], self.tickets[self.next]
                event = ticket.result() if isinstance(ticket, Future) else ticket
                self.next += 1
                if event is not None:
                    stream.wait_event(event)
                consumed.append(seg)
        except BaseException:
            self.tickets = None  # the step failed; do not wait on it again
            raise
        if self.next >= len(self.order):
            self.tickets = None
        publish_segments(consumed, self.comms, self.allgather_bucket_size, self.overlap_comm)


def forward_order(module: torch.nn.Module, segments: list[Segment]) -> list[Segment]:
    """``segments`` sorted by the registration position of the first module holding one of their
    parameters directly (a proxy for the order the forward uses them; any order is exact, a wrong
    guess only costs overlap)."""
    first: dict[int, int] = {}
    for index, m in enumerate(module.modules()):
        for p in m._parameters.values():
            if p is not None:
                first.setdefault(id(p), index)
    big = len(first) + 1

    def key(seg: Segment) -> int:
        return min((first.get(id(s.param), big) for s in seg.slots), default=big)

    return sorted(segments, key=key)


def module_needs(
    module: torch.nn.Module, segments: list[Segment], pos: dict[int, int], ran: set[int]
) -> dict[int, int]:
    """``{id(submodule): k}``: the forward pre-hook of that submodule must consume ``order[:k+1]``.

    Models read parameters of submodules that never run themselves (fused QKV or gate/up projections
    concatenate ``q_proj.weight``...). So each parameter of ``segments`` (those read in place: not
    stage-3 shards) is the responsibility of the nearest module, itself or an ancestor, whose forward
    was seen to run (``ran``: ids of modules whose pre-hook fired so far; the root when none did).
    Such an ancestor's hook fires before any code inside it reads the parameter.
    """
    seg_of = {id(s.param): seg for seg in segments for s in seg.slots}
    parents: dict[int, list[torch.nn.Module]] = {}
    for m in module.modules():
        for child in m.children():
            parents.setdefault(id(child), []).append(m)
    out: dict[int, int] = {}

    def assign(m: torch.nn.Module, k: int, seen: set[int]) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        if id(m) in ran or m is module:
            out[id(m)] = max(out.get(id(m), -1), k)
            return
        for parent in parents.get(id(m), ()):
            assign(parent, k, seen)

    for m in module.modules():
        for p in m._parameters.values():
            if p is not None and id(p) in seg_of:
                assign(m, pos[id(seg_of[id(p)])], set())
    return out
