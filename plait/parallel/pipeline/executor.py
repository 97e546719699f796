"""The one pipeline executor: ``PipelineExecutor.run`` runs any rank's action list
(``plait.parallel.pipeline.schedules``).

Actions (``Action(kind, microbatch, chunk)``; chunk ``c`` is virtual stage ``stage_of(rank, c, p, shape)``):
F (run the chunk; the last stage keeps ``scale_loss(loss)``, default ``loss / m``), B (backward,
``.grad`` accumulates), BI / BW (the zero-bubble split, ``plait.parallel.pipeline.backward``),
SEND_F / SEND_B (posted, never waited on inside the step), RECV_F / RECV_B (posted ahead; the reading
action waits for it, a stream wait on GPU). With ``tp_slices`` each tp rank sends its ``1/tp`` part and
the reader all-gathers the ``activation_shape`` tensor. Python's cyclic GC is paused for the step.

Memory: inputs, outputs and received gradients are dropped after their last use, so a rank holds the
activations of the micro-batches in flight plus receives posted ahead. ``time_compute = True`` records a
per-action ``timeline`` (``ActionTime``). More: ``docs/pipeline.md``.
"""

from __future__ import annotations

import gc
import math
import time

from collections.abc import Callable

import torch

from plait.parallel.pipeline.p2p import StageP2P, TPSlices, Transfer
from plait.parallel.pipeline.backward import backward_input, backward_weight
from plait.parallel.pipeline.graphs import ActionGraphs
from plait.parallel.pipeline.schedules import Action, rank_chunk_of, stage_of
from plait.parallel.pipeline.stage import takes_keyword
from plait.parallel.pipeline.timing import ActionTime, mark, timeline


MODEL_INPUTS = ("input_ids", "labels", "attention_mask", "position_ids", "token_type_ids")


class PipelineExecutor:
    """Runs one rank's action list over its local chunks.

    Args:
        chunks: this rank's model chunks (``v`` modules, each called as
            ``chunk(hidden=x, **batch)``, with ``aux_loss_scale=s`` where its forward takes it).
        p2p: ``StageP2P`` of this rank (unused when ``p == 1``).
        p, rank: pipeline size and this rank's pipeline coordinate.
        activation_shape: ``batch -> shape`` of the activation entering a stage > 0 for that
            micro-batch (e.g. ``[b, s, h]``, ``[b, s/tp, h]`` under sequence parallelism);
            evaluated per micro-batch, so micro-batches may differ in sequence length.
        dtype, device: of activations and gradients sent between stages.
        grads_ready: optional ``callback(chunk_index)`` called when a chunk's last weight-gradient
            action of the step has run (its ``.grad`` is final for this step, before tied sums).
        tp_slices: ``TPSlices`` over this rank's tp group to send only ``1/tp`` of every transfer and
            all-gather it on receipt (module docstring); None (default): send whole tensors. Only valid
            when the tensors crossing a stage boundary are identical on all tp ranks of a stage.
        shape: the stage placement of the action lists (``plait.parallel.pipeline.schedules.stage_of``): "loop"
            (default) or "v" (schedule "zb-v").
        cuda_graphs: training steps replay each compute action as a CUDA graph
            (``plait.parallel.pipeline.graphs.ActionGraphs``, built here over ``chunks``: captured at the first
            step, and again when shapes change); False (default): eager. Evaluation steps always run eagerly.

    ``run`` takes the per-step callbacks (``scale_loss``, ``on_micro_batch``) as arguments.

    After ``run``, ``peak_in_flight`` is the most (micro-batch, chunk) forwards whose input-gradient
    backward had not run yet, held at once: ``simulate(...).peak_in_flight`` of this rank; and
    ``sent_elements`` maps each ``Transfer`` this rank posted in the step to the number of elements it
    carried (``b*s*h`` whole, ``ceil(b*s*h / tp)`` with ``tp_slices``).
    """

    def __init__(
        self,
        chunks: list,
        p2p: StageP2P,
        p: int,
        rank: int,
        activation_shape: Callable[[dict], tuple],
        dtype: torch.dtype,
        device: torch.device,
        grads_ready: Callable[[int], None] | None = None,
        *,
        tp_slices: TPSlices | None = None,
        shape: str = "loop",
        cuda_graphs: bool = False,
    ):
        self.chunks, self.p2p, self.p, self.rank, self.shape = chunks, p2p, p, rank, shape
        self.tp_slices = tp_slices
        self._takes_scale = [takes_keyword(chunk, "aux_loss_scale") for chunk in chunks]
        self.graphs = ActionGraphs(chunks, self._takes_scale, device) if cuda_graphs else None
        self.v = len(chunks)
        self.last = p * self.v - 1
        self.activation_shape, self.dtype, self.device = activation_shape, dtype, device
        self.grads_ready = grads_ready
        # Set ``time_compute = True`` to time each compute action: after ``run``, ``timeline`` holds an
        # ``ActionTime`` per action and ``busy_seconds`` their summed duration (for bubble measurements).
        self.time_compute, self.busy_seconds, self.timeline = False, 0.0, []
        self.peak_in_flight, self.sent_elements = 0, {}  # of the last ``run`` (class docstring)
        self._compute = {
            "F": self._do_F,
            "B": self._do_B,
            "BI": self._do_BI,
            "BW": self._do_BW,
        }  # by Action.kind

    def stage(self, chunk: int) -> int:
        return stage_of(self.rank, chunk, self.p, self.shape)

    def _local_chunk(self, stage: int) -> int | None:
        """This rank's chunk holding virtual ``stage`` (a hand-over needs no transfer), else None."""
        rank, chunk = rank_chunk_of(stage, self.p, self.shape)
        return chunk if rank == self.rank else None

    # ---- one step ---------------------------------------------------------------------------
    def run(
        self,
        actions: list[Action],
        microbatches: list[dict],
        train: bool = True,
        *,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        on_micro_batch: Callable[[], None] | None = None,
    ) -> list[torch.Tensor]:
        """Run ``actions`` on ``microbatches`` (m dicts of tensors on ``device``).

        Args:
            scale_loss: maps a last-stage micro-batch loss (scalar) to what its backward differentiates;
                default ``loss * (1 / m)``. fp16 loss scaling and 1/GAS live here. It must be linear: each
                chunk whose forward takes ``aux_loss_scale`` gets its factor, for losses its layers add through
                the gradient.
            on_micro_batch: called once per micro-batch when this rank's last backward action of it
                (B or BW of its last chunk) has run, e.g. ``ZeroOptimizer.note_micro_step``.

        Returns:
            On a rank holding the last stage, the m unscaled micro-batch losses (detached scalars on
            the device, no host sync) in micro-batch order; else an empty list.

        Raises:
            RuntimeError: an action found its input missing (the list is not a valid schedule
                for this rank; ``check_schedule`` names the problem), or state was left over.
            ValueError: with ``cuda_graphs``, what a capture cannot replay (``ActionGraphs.prepare``).
        """
        self._begin(actions, microbatches, train, scale_loss, on_micro_batch)
        if self._graphed:
            self.graphs.prepare(
                actions,
                [self._model_inputs(mb) for mb in range(self._m)],
                [None if self.stage(c) == 0 else self._shape(0) for c in range(self.v)],
                self.dtype,
                self._aux_scale,
            )
        collecting = gc.isenabled()
        gc.disable()  # no cyclic-GC pause inside the step (module docstring); reference counting still frees
        try:
            spans = self._run_actions(actions)
        finally:
            if collecting:
                gc.enable()
        if self.time_compute:
            self.timeline = spans
            self.busy_seconds = sum(t.end - t.start for t in self.timeline)
        self._check_empty()
        return [self._losses[i] for i in sorted(self._losses)]

    def _run_actions(self, actions: list[Action]) -> list[ActionTime]:
        spans = []
        origin = mark(self.device) if self.time_compute else None
        for action in actions:
            if not action.is_compute:
                self._post(action)
                continue
            self._reap_sends()
            self._await_inputs(action)
            start = mark(self.device) if self.time_compute else None
            host = time.perf_counter()
            self._compute[action.kind](action.microbatch, action.chunk)
            if start is not None:
                spans.append((action, start, mark(self.device), time.perf_counter() - host))
        for work, _ in self._sends:
            work.wait()
        self._sends = []
        return timeline(self.device, origin, spans) if self.time_compute else []

    def _begin(self, actions, microbatches, train, scale_loss, on_micro_batch) -> None:
        self._m, self._mbs, self._train = len(microbatches), microbatches, train
        self._graphed = train and self.graphs is not None
        m = self._m
        self._scale_loss = scale_loss or (lambda loss: loss * (1.0 / m))
        self._aux_scale = float(
            self._scale_loss(torch.ones(()))
        )  # d scaled / d loss, for the chunks' own losses
        self._on_micro_batch, self._mb_left = on_micro_batch, dict.fromkeys(range(m), self.v)
        self._inputs, self._saved, self._grad_out, self._grad_in = {}, {}, {}, {}
        self._to_send, self._pending, self._losses, self._sends = {}, {}, {}, []
        self._remaining = self._weight_actions(actions) if train else {}
        self.peak_in_flight, self.sent_elements = 0, {}

    def _check_empty(self) -> None:
        left = {
            name: sorted(d)
            for name, d in (
                ("inputs", self._inputs),
                ("saved", self._saved),
                ("grad_out", self._grad_out),
                ("grad_in", self._grad_in),
                ("to_send", self._to_send),
                ("pending BW", self._pending),
            )
            if d
        }
        if left:
            raise RuntimeError(
                f"pipeline rank {self.rank}: state left after the step {left}; the action "
                f"list is incomplete (run check_schedule on it)"
            )

    def _weight_actions(self, actions: list[Action]) -> dict[int, int]:
        count: dict[int, int] = {}
        for a in actions:
            if a.kind in ("B", "BW"):
                count[a.chunk] = count.get(a.chunk, 0) + 1
        return count

    def _take(self, store: dict, key, what: str):
        if key not in store:
            raise RuntimeError(
                f"pipeline rank {self.rank}: {what} of micro-batch {key[0]}, chunk {key[1]} "
                f"is missing; the action list runs it too early (run check_schedule)"
            )
        return store.pop(key)

    # ---- communication ----------------------------------------------------------------------
    def _post(self, a: Action) -> None:
        """Post one SEND_*/RECV_* without waiting (see ``plait.parallel.pipeline.p2p``); with ``tp_slices`` only
        this tp rank's part of the tensor travels."""
        key, s = (a.microbatch, a.chunk), self.stage(a.chunk)
        if a.kind in ("SEND_F", "SEND_B"):
            forward = a.kind == "SEND_F"
            tensor = (
                self._take(self._to_send, key, "output to send")
                if forward
                else self._take(self._grad_in, key, "input gradient")
            )
            if self.tp_slices is not None:
                tensor = self.tp_slices.part(tensor)
            transfer = Transfer(a.kind[-1], a.microbatch, s)
            self._sends.append((self.p2p.send(transfer, tensor), tensor))
            self.sent_elements[transfer] = tensor.numel()
            return
        # RECV_F: this stage's input; RECV_B: the gradient of its output. Both have the shape of the
        # activation between two stages for this micro-batch (or are this tp rank's part of it).
        shape = self._shape(a.microbatch)
        if self.tp_slices is not None:
            shape = (self.tp_slices.part_numel(math.prod(shape)),)
        buf = torch.empty(shape, dtype=self.dtype, device=self.device)
        forward = a.kind == "RECV_F"
        work = self.p2p.recv(Transfer(a.kind[-1], a.microbatch, s - 1 if forward else s + 1), buf)
        (self._inputs if forward else self._grad_out)[key] = (buf, work)

    def _shape(self, mb: int) -> tuple[int, ...]:
        """Shape of the activation (and of its gradient) between two stages for micro-batch ``mb``."""
        return tuple(self.activation_shape(self._mbs[mb]))

    def _await_inputs(self, a: Action) -> None:
        """Wait (a stream wait on GPU) for the received tensor the compute action ``a`` reads, if any;
        with ``tp_slices``, then all-gather the tp ranks' parts of it into the whole tensor."""
        s = self.stage(a.chunk)
        store = self._inputs if a.kind == "F" and s > 0 else None
        if a.kind in ("B", "BI") and s < self.last:
            store = self._grad_out
        entry = None if store is None else store.get((a.microbatch, a.chunk))
        if (
            entry is not None and entry[1] is not None
        ):  # a posted receive (local hand-overs have no work)
            buf, work = entry
            work.wait()
            if self.tp_slices is not None:
                buf = self.tp_slices.gather(buf, self._shape(a.microbatch))
            store[(a.microbatch, a.chunk)] = (buf, None)

    def _reap_sends(self) -> None:
        """Drop finished sends (and their tensors), wherever they are in the queue."""
        if self._sends:
            self._sends = [(work, t) for work, t in self._sends if not work.is_completed()]

    # ---- compute ----------------------------------------------------------------------------
    def _model_inputs(self, mb: int) -> dict:
        return {k: t for k, t in self._mbs[mb].items() if k in MODEL_INPUTS}

    def _do_F(self, mb: int, chunk: int) -> None:
        s, key = self.stage(chunk), (mb, chunk)
        x = None if s == 0 else self._take(self._inputs, key, "input activation")[0]
        batch = self._model_inputs(mb)
        if self._graphed:
            out = self.graphs.forward(
                chunk, mb, x, batch
            )  # the slot's static output, kept until its backward
            x = None
        else:
            x = None if x is None else x.requires_grad_(self._train)
            with torch.set_grad_enabled(self._train):
                if self._takes_scale[chunk]:
                    batch["aux_loss_scale"] = self._aux_scale
                out = self.chunks[chunk](hidden=x, **batch)
        if s == self.last:
            if out.dim() != 0:
                raise ValueError(
                    f"the last pipeline stage returned shape {tuple(out.shape)}, not a scalar "
                    f"loss; give every micro-batch 'labels'"
                )
            self._losses[mb] = out.detach().clone() if self._graphed else out.detach()
            out = None if self._graphed else self._scale_loss(out)
        elif (
            nxt := self._local_chunk(s + 1)
        ) is not None:  # a chunk of this same rank: hand over directly
            self._inputs[(mb, nxt)] = (out.detach(), None)
        else:
            self._to_send[key] = out.detach()
        if self._train:
            self._saved[key] = (out, x)
            self.peak_in_flight = max(self.peak_in_flight, len(self._saved))

    def _input_grad_ready(self, mb: int, chunk: int, grad: torch.Tensor | None) -> None:
        s = self.stage(chunk)
        if s == 0:
            return
        if (prev := self._local_chunk(s - 1)) is not None:
            self._grad_out[(mb, prev)] = (grad, None)
        else:
            self._grad_in[(mb, chunk)] = grad

    def _backward_inputs(self, mb: int, chunk: int):
        out, x = self._take(self._saved, (mb, chunk), "saved forward")
        grad = (
            None
            if self.stage(chunk) == self.last
            else self._take(self._grad_out, (mb, chunk), "output gradient")[0]
        )
        return out, grad, x

    def _weights_done(self, mb: int, chunk: int) -> None:
        self._remaining[chunk] -= 1
        if self._remaining[chunk] == 0 and self.grads_ready is not None:
            self.grads_ready(chunk)
        self._mb_left[mb] -= 1
        if self._mb_left[mb] == 0 and self._on_micro_batch is not None:
            self._on_micro_batch()

    def _do_B(self, mb: int, chunk: int) -> None:
        out, grad, x = self._backward_inputs(mb, chunk)
        if self._graphed:
            gx = self.graphs.backward("B", chunk, mb, grad, self._aux_scale)
        else:
            torch.autograd.backward(out, grad)  # parameters and the stage input (a leaf of our own)
            gx = None if x is None else x.grad
        del out, grad, x
        self._input_grad_ready(mb, chunk, gx)
        self._weights_done(mb, chunk)

    def _do_BI(self, mb: int, chunk: int) -> None:
        out, grad, x = self._backward_inputs(mb, chunk)
        if self._graphed:
            gx, self._pending[(mb, chunk)] = (
                self.graphs.backward("BI", chunk, mb, grad, self._aux_scale),
                None,
            )
        else:
            gx, self._pending[(mb, chunk)] = backward_input(out, grad, x)
        del out, grad, x
        self._input_grad_ready(mb, chunk, gx)

    def _do_BW(self, mb: int, chunk: int) -> None:
        pending = self._take(self._pending, (mb, chunk), "BI result")
        if self._graphed:
            self.graphs.backward("BW", chunk, mb, None, self._aux_scale)
        else:
            backward_weight(pending)
        self._weights_done(mb, chunk)
