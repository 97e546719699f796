"""CUDA graphs for a pipeline rank's compute actions: each action's kernels launched by one graph replay
(``PipelineParallel(cuda_graphs=True)``; the mechanism of ``torch.cuda.make_graphed_callables``).

``ActionGraphs`` captures, per *slot* (one micro-batch in flight of a chunk; ``slots_needed``), F and
then B or BI/BW into the slot's memory pool; each action copies its inputs into static tensors and
replays, and ``run_tails`` accumulates ``.grad`` so ZeRO-1/2 hooks fire as without graphs. Results are
bitwise the eager executor's (``tests/gpu/run_pipeline_graphs.py``).

Requirements (``ValueError`` naming the cause: ``check_device``, ``check_capturable``,
``check_same_shapes``): a CUDA device; tp, cp and ep 1; no dropout in training; no module or gradient
hooks (so no ZeRO-3 or parameter offload); every micro-batch of a step with the same keys and shapes.
A step whose shapes, slots, parameters or modes changed captures again. Why, capture details and
memory: ``docs/pipeline.md``; measured: ``benchmarks/results/pipeline_graphs_H100.md``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import get_gradient_edge

from plait.parallel.pipeline.backward import backward_input, run_tails, weight_gradients


def slots_needed(actions, v: int) -> list[int]:
    """Per chunk, the most micro-batches ``actions`` (one rank's list) holds between their F and their last
    backward action (B or BW) at once: the CUDA-graph slots that chunk needs."""
    held, peak = [0] * v, [0] * v
    for a in actions:
        if a.kind == "F":
            held[a.chunk] += 1
            peak[a.chunk] = max(peak[a.chunk], held[a.chunk])
        elif a.kind in ("B", "BW"):
            held[a.chunk] -= 1
    return peak


def backward_kinds(actions, v: int) -> list[str | None]:
    """Per chunk, "B" or "BI/BW": the backward actions ``actions`` runs it with (None: none).

    Raises:
        ValueError: a chunk runs both B and the BI/BW split in one list.
    """
    kinds: list[set] = [set() for _ in range(v)]
    for a in actions:
        if a.kind in ("B", "BI", "BW"):
            kinds[a.chunk].add("B" if a.kind == "B" else "BI/BW")
    if any(len(k) > 1 for k in kinds):
        raise ValueError(
            "cuda_graphs captures one backward per chunk, but this action list runs a chunk with "
            "both B and BI/BW; use the eager executor (cuda_graphs=False) for this list"
        )
    return [next(iter(k)) if k else None for k in kinds]


def check_device(device: torch.device) -> None:
    """Raise ValueError unless ``device`` is a CUDA device."""
    if device.type != "cuda":
        raise ValueError(
            f"cuda_graphs needs the pipeline on a CUDA device, not {device}; pass cuda_graphs=False "
            f"on CPU"
        )


def check_same_shapes(batches: list[dict]) -> None:
    """Raise ValueError unless every micro-batch has micro-batch 0's keys, shapes and dtypes (named)."""
    first = _shapes(batches[0])
    for i, other in enumerate(batches):
        if _shapes(other) != first:
            raise ValueError(
                f"cuda_graphs replays one shape per step, but micro-batch {i} has {_shapes(other)} and "
                f"micro-batch 0 {first}; give the micro-batches of a step the same keys and pad them to "
                f"one shape, or pass cuda_graphs=False"
            )


def check_capturable(chunks: list) -> None:
    """Raise ValueError (naming the module or parameter and the fix) for what a graph cannot replay: module
    hooks (ZeRO-3 and parameter offload gather and free parameters in them), gradient hooks on parameters,
    and dropout in training (plait's ``config.hidden_dropout`` / ``attention_dropout``)."""
    from torch.nn.modules import module as nn_module

    if any(
        getattr(nn_module, name)
        for name in (
            "_global_forward_pre_hooks",
            "_global_forward_hooks",
            "_global_backward_pre_hooks",
            "_global_backward_hooks",
        )
    ):
        raise ValueError(
            "cuda_graphs cannot capture chunks while global module hooks are registered; remove them "
            "or pass cuda_graphs=False"
        )
    for c, chunk in enumerate(chunks):
        for name, mod in chunk.named_modules():
            if (
                mod._forward_pre_hooks
                or mod._forward_hooks
                or mod._backward_hooks
                or mod._backward_pre_hooks
            ):
                raise ValueError(
                    f"cuda_graphs: chunk {c}'s module {name or '<chunk>'} has module hooks (ZeRO-3 and "
                    f"parameter offload gather and free parameters in them); a graph would run them "
                    f"once, at capture. Use ZeRO stage 0-2 without offload_param, or cuda_graphs=False"
                )
        for name, p in chunk.named_parameters():
            if p._backward_hooks:
                raise ValueError(
                    f"cuda_graphs: parameter {name} of chunk {c} has a gradient hook (register_hook), "
                    f"which a graph would run only at capture; use register_post_accumulate_grad_hook, "
                    f"or cuda_graphs=False"
                )
        config = getattr(chunk, "config", None)
        drop = max(
            getattr(config, "hidden_dropout", 0.0), getattr(config, "attention_dropout", 0.0)
        )
        if chunk.training and drop > 0:
            raise ValueError(
                f"cuda_graphs: chunk {c} trains with dropout {drop} (its RNG state is set per call, "
                f"which a capture cannot do); set the dropouts to 0 or pass cuda_graphs=False"
            )


@dataclass
class _Slot:
    pool: object
    x: torch.Tensor | None
    batch: dict
    out: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    gx: torch.Tensor | None = None
    tails: tuple = ((), ())
    graphs: dict = field(default_factory=dict)


class ActionGraphs:
    """CUDA graphs of one rank's pipeline actions (module docstring), built by the executor.

    Args:
        chunks: this rank's chunks (the executor's).
        takes_scale: per chunk, whether its forward takes ``aux_loss_scale``.
        device: their CUDA device.

    Attributes:
        captures: how many times the slots were captured (once, then again per change listed above).

    Raises:
        ValueError: ``device`` is not a CUDA device.
    """

    def __init__(self, chunks: list, takes_scale: list[bool], device: torch.device):
        check_device(device)
        self.chunks, self.device, self._takes_scale = chunks, device, takes_scale
        self.captures = 0
        self._slots: list[list[_Slot]] = [[] for _ in chunks]
        self._held: dict = {}  # (micro-batch, chunk) -> its slot, from F to its last backward action
        self._key = None
        self._stream = torch.cuda.Stream(device)

    # ---- capture ------------------------------------------------------------------------------
    def prepare(
        self, actions, batches: list[dict], x_shapes: list, dtype: torch.dtype, aux_scale: float
    ) -> None:
        """Capture the slots ``actions`` needs for the step's micro-batches ``batches`` (model inputs only) and,
        per chunk, stage inputs of ``x_shapes[c]`` (None: the first stage) and ``dtype``, unless they are
        captured already. ``aux_scale`` is passed as ``aux_loss_scale`` to the chunks whose forward takes it.
        Call at the step's start, with no transfer in flight.

        Raises:
            ValueError: micro-batches of different keys, shapes or dtypes (:func:`check_same_shapes`); hooks or
                dropout in a chunk (:func:`check_capturable`); a chunk run with both B and BI/BW
                (:func:`backward_kinds`).
        """
        check_same_shapes(batches)
        batch, v = batches[0], len(self.chunks)
        slots, kinds = slots_needed(actions, v), backward_kinds(actions, v)
        params = [[p for p in chunk.parameters() if p.requires_grad] for chunk in self.chunks]
        scaled = [dict(aux_loss_scale=aux_scale) if takes else {} for takes in self._takes_scale]
        key = (
            _shapes(batch),
            tuple(x_shapes),
            dtype,
            aux_scale if any(self._takes_scale) else None,
            tuple(slots),
            tuple(kinds),
            tuple(chunk.training for chunk in self.chunks),
            tuple(p.data_ptr() for ps in params for p in ps),
        )
        self._held = {}  # a step that raised may have left slots taken
        if key == self._key:
            return
        check_capturable(self.chunks)
        self._slots, self._key = [[] for _ in range(v)], None
        for c, chunk in enumerate(self.chunks):
            x = (
                None
                if x_shapes[c] is None
                else torch.zeros(x_shapes[c], dtype=dtype, device=self.device)
            )
            self._warm_up(chunk, x, {**batch, **scaled[c]}, params[c])
            self._slots[c] = [
                self._capture(c, kinds[c], x, batch, params[c], scaled[c]) for _ in range(slots[c])
            ]
        self._key = key
        self.captures += 1

    def _warm_up(self, chunk, x, batch, params) -> None:
        """One eager forward and backward on the capture stream (lazy library set-up must not happen inside
        a capture); ``autograd.grad``, so nothing accumulates into ``.grad``."""
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            inp = None if x is None else x.detach().clone().requires_grad_()
            out = chunk(hidden=inp, **batch)
            torch.autograd.grad(
                out,
                ([] if inp is None else [inp]) + params,
                torch.ones_like(out),
                allow_unused=True,
            )
        torch.cuda.current_stream(self.device).wait_stream(self._stream)

    @contextmanager
    def _graph(self, slot: _Slot, kind: str):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph, pool=slot.pool, stream=self._stream, capture_error_mode="thread_local"
        ):
            yield
        slot.graphs[kind] = graph

    def _capture(
        self, c: int, kind: str | None, x, batch: dict, params: list, extra: dict
    ) -> _Slot:
        slot = _Slot(
            pool=torch.cuda.graph_pool_handle(),
            batch={k: t.clone() for k, t in batch.items()},
            x=None if x is None else x.clone().requires_grad_(),
        )
        with self._graph(slot, "F"):
            out = self.chunks[c](hidden=slot.x, **slot.batch, **extra)
        slot.out = out.detach()
        slot.grad = torch.ones_like(out) if out.dim() == 0 else torch.zeros_like(out)
        inputs = [] if slot.x is None else [slot.x]
        if kind == "B" or (
            kind is not None and slot.x is None
        ):  # first stage: BI is empty, BW the whole backward
            with self._graph(slot, "B" if kind == "B" else "BW"):
                grads = torch.autograd.grad(out, inputs + params, slot.grad, allow_unused=True)
            slot.gx = grads[0] if inputs else None
            slot.tails = _param_tails(params, grads[len(inputs) :])
        elif kind is not None:
            with self._graph(slot, "BI"):
                slot.gx, pending = backward_input(out, slot.grad, slot.x)
            with self._graph(slot, "BW"):
                if pending.split:
                    slot.tails = weight_gradients(pending)
                else:  # the cut's fallback: BW is the whole backward (pipeline_backward)
                    grads = torch.autograd.grad(
                        pending.output, params, pending.grad_output, allow_unused=True
                    )
                    slot.tails = _param_tails(params, grads)
        return slot

    # ---- replay -------------------------------------------------------------------------------
    def forward(self, chunk: int, mb: int, x: torch.Tensor | None, batch: dict) -> torch.Tensor:
        """F of micro-batch ``mb``: takes a free slot of ``chunk`` until its last backward action, copies ``x`` (the
        stage input, ``activation_shape``; None on the first stage) and ``batch`` (its captured keys and shapes)
        into it and replays. Returns the slot's static output (``activation_shape``; the scalar loss on the last
        stage), valid until that backward action."""
        taken = {id(s) for s in self._held.values()}
        slot = next((s for s in self._slots[chunk] if id(s) not in taken), None)
        if slot is None:
            raise RuntimeError(
                f"cuda_graphs: no free slot of chunk {chunk} for micro-batch {mb}; the action list "
                f"differs from the one prepare() captured for"
            )
        self._held[(mb, chunk)] = slot
        with torch.no_grad():
            if slot.x is not None:
                slot.x.copy_(x)
            for k, t in batch.items():
                slot.batch[k].copy_(t)
        slot.graphs["F"].replay()
        return slot.out

    def backward(self, kind: str, chunk: int, mb: int, grad: torch.Tensor | None, loss_grad: float):
        """B, BI or BW of micro-batch ``mb``: ``grad`` is the output's gradient (B, BI: the output's shape; None on
        the last stage, whose scalar loss gets ``loss_grad``). Returns a copy of the input gradient (B, BI: the
        stage input's shape; None on the first stage and for BW); B and BW accumulate into ``.grad``."""
        slot = self._held[(mb, chunk)]
        if kind != "BW":
            if grad is None:
                slot.grad.fill_(loss_grad)
            else:
                slot.grad.copy_(grad)
        if kind in slot.graphs:
            slot.graphs[kind].replay()
        if kind != "BI":
            run_tails(*slot.tails, keep_graph=True)  # the same tail nodes run again at every replay
            del self._held[(mb, chunk)]
        if kind != "BW" and slot.gx is not None:
            return slot.gx.clone()
        return None


def _shapes(batch: dict) -> dict:
    return {k: (tuple(t.shape), str(t.dtype).replace("torch.", "")) for k, t in batch.items()}


def _param_tails(params: list, grads) -> tuple[list, list]:
    """``(edges, grads)`` for ``run_tails``: each parameter's gradient into its ``AccumulateGrad``."""
    pairs = [(get_gradient_edge(p), g) for p, g in zip(params, grads) if g is not None]
    return [e for e, _ in pairs], [g for _, g in pairs]
