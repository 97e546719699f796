"""Pipeline parallelism: ``PipelineParallel(stage_modules, mesh, schedule, m, v).train_batch(data_iter)``.

Ties ``partition`` (the layer cut), ``schedules`` (each rank's actions), ``comm_actions.with_communication``
(sends and receives) and ``executor.PipelineExecutor`` into one training (``train_batch``) or evaluation
(``eval_batch``) step, and owns the tied gradient sum (``sum_tied_gradients``).

Contract: after ``train_batch`` the parameters' ``.grad`` hold what plain gradient accumulation over the
same m micro-batches holds with the loss averaged over micro-batches (``loss_i / m``, each ``loss_i`` the
mean over tokens with ``labels != -100``), added to what ``.grad`` held. Nothing is reduced over dp and
no optimizer steps (the engine and ZeRO do). ``grads_ready(chunk)`` fires when a chunk's ``.grad`` is
final, except the ``tied_parameters``, which change once more in ``sum_tied_gradients``. Engine use and
hooks: ``docs/pipeline.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from plait.parallel.pipeline.p2p import StageP2P, TPSlices, channel_groups
from plait.parallel.pipeline.executor import PipelineExecutor
from plait.parallel.pipeline.graphs import check_device
from plait.parallel.pipeline.schedules import Action, rank_of
from plait.parallel.pipeline.registry import get_schedule, placement
from plait.parallel.pipeline.simulate import stage_costs
from plait.parallel.pipeline.comm_actions import with_communication
from plait.parallel.pipeline.stage import StageChunk, check_layer_order, check_stage_modules


def measures_costs(schedule_costs, schedule: str) -> bool:
    """Whether the stage costs are measured on the first step (``schedule_costs="measure"``, zb-v only);
    raises ValueError for another string or schedule."""
    measure = isinstance(schedule_costs, str)
    if measure and (schedule_costs != "measure" or schedule != "zb-v"):
        raise ValueError(
            f"schedule_costs={schedule_costs!r} with schedule {schedule!r}: only 'zb-v' plans for "
            f"measured costs, and the string form is 'measure'"
        )
    return measure


class PipelineParallel:
    """Runs this rank's pipeline chunks through a schedule, one step per ``train_batch`` call.

    Args:
        stage_modules: this rank's ``v`` chunks in chunk order, each a ``StageChunk``
            (``plait.parallel.pipeline.stage``; ``plait.layers.stages.build_stage_modules`` builds plait's);
            chunk ``c`` is virtual stage ``stage_of(pp_rank, c, p, placement(schedule))`` (``c*p + pp_rank``
            except for "zb-v": build them with ``build_stage_modules(..., schedule=schedule)``). Each is
            called ``chunk(hidden=x, **batch)``
            (with ``aux_loss_scale=s`` where its forward takes it, ``StageChunk``).
        mesh: ``ParallelMesh`` (None: one process, ``p = 1``).
        schedule: "gpipe", "1f1b", "interleaved" (needs ``v >= 2``), "zb-h1" or "zb-v" (needs ``v = 2``).
        micro_batches: m, micro-batches per step; every schedule runs any ``m >= 1`` (``m < p`` is
            mostly bubble; see ``schedules``).
        virtual_stages: v; must equal ``len(stage_modules)`` (default: that length).
        activation_shape: ``batch -> shape`` of the activation entering a stage > 0. Default: the
            first chunk's ``activation_shape`` (plait's: ``[b, s, hidden]``, ``[b, s/tp, hidden]``
            with sequence parallelism), evaluated per micro-batch, so sequence lengths may vary
            between micro-batches and steps with no shape exchange.
        grads_ready: optional ``callback(chunk_index)`` when that chunk's gradients of the step
            are final (tied embedding copies are summed only after the whole schedule).
        slice_tp: send each tp rank's ``1/tp`` part of the tensors crossing a stage boundary and
            all-gather them on the receiving stage (Megatron-LM's scatter/gather, Narayanan et al.,
            SC'21, Sec. 4.1; ``plait.parallel.pipeline.p2p.TPSlices``). None (default): on exactly when p > 1,
            tp > 1 and every chunk declares ``sequence_parallel`` False (plait's ``TransformerStage``
            does; a chunk without that attribute keeps whole sends). True: on whenever p > 1 and tp > 1
            (you vouch that the activation and its gradient are identical on the tp ranks of a stage).
            False: whole tensors.
        schedule_costs: for "zb-v", what its list scheduler plans for. None: unit costs (the paper's
            setting). A dict: per-virtual-stage durations ``{"F": [...], "BI": [...], "BW": [...]}``, ``p * v``
            values each, the same on every rank of the world (``plait.parallel.pipeline.simulate.stage_costs``).
            "measure": the second ``train_batch`` (the first warms up) times its actions, every rank of the
            world gathers all of them (once; a host synchronization), and the following steps run the lists
            planned for those per-stage medians (``planned_costs``).
        cuda_graphs: replay each training action as a CUDA graph (``plait.parallel.pipeline.graphs``: for
            micro-batches small enough that issuing the kernels from Python sets the pace). Needs a CUDA device
            and tp = cp = ep = 1 (checked here); ZeRO stage 0-2 without parameter offload, no dropout and
            micro-batches of one shape per step (checked at the first training step).

    Attributes:
        schedule_costs, cuda_graphs: the arguments.
        lists: every pipeline rank's compute actions (``get_schedule``'s lists; this rank's, with its
            transfers, are ``actions``).
        planned_costs: the measured per-stage medians (seconds) the lists were planned for after the
            measured step of ``schedule_costs="measure"`` (None before it, and otherwise).
        tied_parameters: this rank's copies of parameters that another stage also holds (the chunks'
            ``tied_parameters()``, chunk order; ``[]`` when none or p x v = 1).
        tied_group: the (first stage, last stage) process group of this rank's (dp, tp) coordinate,
            over which ``sum_tied_gradients`` all-reduces (None when one rank holds both stages: p = 1 or
            "zb-v", or when nothing is tied).
        slice_tp: whether transfers carry tp parts (the resolved ``slice_tp`` argument).

    Construction is collective (every rank of the world constructs PipelineParallel, in the same order).
    What crosses a stage boundary and how tied copies are summed: ``docs/pipeline.md``.

    Raises:
        TypeError: a chunk lacks a ``StageChunk`` member (named).
        ValueError: ``virtual_stages != len(stage_modules)``, bad schedule/m/v or ``schedule_costs`` (from
            ``get_schedule``: unknown name, v not matching the schedule, costs for a schedule other than
            "zb-v", ...; a string other than "measure", or "measure" with another schedule); ``slice_tp=True`` with a
            chunk using sequence parallelism; chunks whose layers do not follow one another in the
            schedule's stage order (e.g. built for another placement; collective over the pipeline group);
            ``cuda_graphs`` off a CUDA device or with tp, cp or ep > 1.
    """

    def __init__(
        self,
        stage_modules: list,
        mesh=None,
        schedule: str = "1f1b",
        micro_batches: int = 1,
        virtual_stages: int | None = None,
        *,
        activation_shape: Callable[[dict], tuple] | None = None,
        grads_ready: Callable[[int], None] | None = None,
        slice_tp: bool | None = None,
        schedule_costs: dict | str | None = None,
        cuda_graphs: bool = False,
    ):
        self.stage_modules = list(stage_modules)
        v = len(self.stage_modules)
        check_stage_modules(self.stage_modules, virtual_stages)
        self.mesh, self.schedule, self.m, self.v = mesh, schedule, micro_batches, v
        self.cuda_graphs = cuda_graphs
        if cuda_graphs:
            self._check_graphs()
        self.p = 1 if mesh is None else mesh.pp
        self.rank = 0 if mesh is None else mesh.pp_rank
        measure = measures_costs(schedule_costs, schedule)
        self.shape, self.schedule_costs = placement(schedule), schedule_costs
        self._use_lists(
            get_schedule(schedule, self.p, micro_batches, v, None if measure else schedule_costs)
        )
        self.planned_costs: dict | None = None
        self._steps, self._measure_step = 0, 1 if measure else None
        self.device = torch.device("cpu") if mesh is None else mesh.device
        self.pp_ranks = [0] if mesh is None else mesh.ranks("pp")
        self.slice_tp = self._resolve_slice_tp(slice_tp)
        check_layer_order(
            self.stage_modules,
            self.p,
            self.rank,
            self.shape,
            None if mesh is None else mesh.pp_group,
        )
        self.executor = self._make_executor(activation_shape, grads_ready)
        self.tied_parameters, self.tied_group = self._tied_embedding_setup()
        self._closed = False

    def _make_executor(self, activation_shape, grads_ready) -> PipelineExecutor:
        """The executor over this rank's chunks, its point-to-point channels connected; activations are sent
        in the dtype of the chunks' first floating-point parameter (float32 without one)."""
        first = next((t for t in self.parameters() if t.is_floating_point()), None)
        dtype = first.dtype if first is not None else torch.float32
        mesh = self.mesh
        p2p = StageP2P(self.pp_ranks, channel_groups(mesh), self.p * self.v, self.rank, self.shape)
        p2p.connect(self.device)
        return PipelineExecutor(
            self.stage_modules,
            p2p,
            self.p,
            self.rank,
            activation_shape or self.stage_modules[0].activation_shape,
            dtype,
            self.device,
            grads_ready,
            tp_slices=TPSlices(mesh.group("tp")) if self.slice_tp else None,
            shape=self.shape,
            cuda_graphs=self.cuda_graphs,
        )

    def _check_graphs(self) -> None:
        check_device(torch.device("cpu") if self.mesh is None else self.mesh.device)
        sizes = (
            {}
            if self.mesh is None
            else {"tp": self.mesh.tp, "cp": self.mesh.cp, "ep": self.mesh.ep}
        )
        if any(size > 1 for size in sizes.values()):
            raise ValueError(
                f"cuda_graphs with {sizes}: the tensor-, context- and expert-parallel collectives inside "
                f"the chunks are not captured; use tp = cp = ep = 1 or cuda_graphs=False"
            )

    def _use_lists(self, lists) -> None:
        """Run ``lists`` (every rank's compute actions) from the next step on."""
        self.lists = lists
        self.actions: list[Action] = with_communication(lists, self.p, self.v, shape=self.shape)[
            self.rank
        ]
        forward_only = [[a for a in acts if a.kind == "F"] for acts in lists]
        self.eval_actions: list[Action] = with_communication(
            forward_only, self.p, self.v, shape=self.shape
        )[self.rank]

    def _plan_from(self, timeline) -> None:
        """Plan the lists for the stage times of this measured step on every rank of the world (all must run
        the same lists: tp and ZeRO collectives inside the actions pair up across pipeline columns)."""
        mine = (self.rank, list(timeline))
        world = [mine]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            world = [None] * dist.get_world_size()
            dist.all_gather_object(world, mine)
        timelines = [[] for _ in range(self.p)]
        for rank, actions in world:
            timelines[rank] += actions
        self.planned_costs = stage_costs(timelines, self.p, self.v, self.shape)
        costs = {k: self.planned_costs.get(k, [0.0] * (self.p * self.v)) for k in ("F", "BI", "BW")}
        self._use_lists(get_schedule(self.schedule, self.p, self.m, self.v, costs))

    def _resolve_slice_tp(self, slice_tp: bool | None) -> bool:
        """The ``slice_tp`` argument resolved (class docstring), from the mesh and the chunks'
        ``sequence_parallel`` attribute."""
        sp = [getattr(chunk, "sequence_parallel", None) for chunk in self.stage_modules]
        if (
            self.p == 1 or self.mesh.tp == 1
        ):  # nothing crosses a stage boundary, or nothing to slice
            return False
        if slice_tp and any(sp):
            raise ValueError(
                "slice_tp=True needs activations identical on the tp ranks of a stage, but the chunks "
                "use sequence parallelism (each tp rank holds its own [b, s/tp, h]); use "
                "slice_tp=None or False"
            )
        if slice_tp is None:
            return all(flag is not None and not flag for flag in sp)
        return bool(slice_tp)

    # ---- parameters -------------------------------------------------------------------------
    def named_parameters(self) -> Iterable[tuple[str, torch.nn.Parameter]]:
        """This rank's parameters under their global names (``layers.5.attn.q_proj.weight``)."""
        for chunk in self.stage_modules:
            yield from chunk.named_parameters()

    def parameters(self) -> Iterable[torch.nn.Parameter]:
        for _, param in self.named_parameters():
            yield param

    # ---- tied embeddings --------------------------------------------------------------------
    def _tied_embedding_setup(self):
        """Local tied copies and the (first stage, last stage) group; collective over the world."""
        chunks: list[StageChunk] = self.stage_modules
        if not chunks[0].tied_across_stages or self.p * self.v == 1:
            return [], None
        params = [t for chunk in chunks for t in chunk.tied_parameters()]
        if self._ends_on_one_rank():
            return params, None
        return params, self.mesh.new_column_group(lambda column: [column[0], column[-1]])

    def _ends_on_one_rank(self) -> bool:
        """Whether one pipeline rank holds both the first and the last stage (p = 1, or "zb-v")."""
        return rank_of(0, self.p, self.shape) == rank_of(self.p * self.v - 1, self.p, self.shape)

    @torch.no_grad()
    def sum_tied_gradients(self, grads: list[torch.Tensor] | None = None) -> None:
        """Sum the tied copies' gradients in place, on both stages: the one place this is done.
        The copies stay bitwise equal because both sides add the same two values. Collective over
        ``tied_group`` (none when this rank holds both copies: p = 1 or "zb-v").

        Args:
            grads: one tensor per entry of ``tied_parameters`` (same order, equal shapes on both
                stages), e.g. an engine's dp-reduced gradients of the copies; default: their ``.grad``
                (zeros where None).
        """
        if not self.tied_parameters:
            return
        if grads is None:
            grads = []
            for param in self.tied_parameters:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grads.append(param.grad)
        if self.tied_group is None:  # both copies on this rank, in different chunks
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
            return
        for grad in grads:
            dist.all_reduce(grad, group=self.tied_group)

    def _refresh_dtype(self) -> None:
        """Receive activations in the parameters' current dtype (ZeRO may cast the chunks to bf16/fp16
        after this pipeline was built; a parameter ZeRO-3 released is an empty tensor of that dtype)."""
        first = next((t for t in self.parameters() if t.is_floating_point()), None)
        if first is not None:
            self.executor.dtype = first.dtype

    # ---- steps ------------------------------------------------------------------------------
    def close(self) -> None:
        """Destroys this rank's process groups of the pipeline (the two p2p channels, the tied-gradient
        group). Call it on every rank, in the same order (NCCL may wait for a group's peers). Each NCCL group
        holds communicator buffers on the device, so a process that builds several pipelines (a benchmark, a
        sweep) should close each one it is done with. Closing twice does nothing; ``train_batch``/``eval_batch``
        on a closed pipeline raise RuntimeError."""
        p2p = self.executor.p2p
        for group in (*p2p.groups, self.tied_group):
            if group is not None:
                dist.destroy_process_group(group)
        p2p.groups, self.tied_group, self._closed = (None, None), None, True

    def _pull(self, data_iter) -> list[dict]:
        if self._closed:
            raise RuntimeError(
                "this PipelineParallel was closed (its process groups are destroyed); build a "
                "new one to run more steps"
            )
        it = data_iter if hasattr(data_iter, "__next__") else iter(data_iter)
        out = []
        for i in range(self.m):
            try:
                batch = next(it)
            except StopIteration:
                raise ValueError(
                    f"the data iterator ran out after {i} of {self.m} micro-batches; give "
                    f"train_batch/eval_batch at least micro_batches={self.m} batches"
                ) from None
            out.append(
                {k: (t.to(self.device) if torch.is_tensor(t) else t) for k, t in batch.items()}
            )
        return out

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        if losses:
            loss = torch.stack([x.float() for x in losses]).mean()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.p > 1:
            last = rank_of(
                self.p * self.v - 1, self.p, self.shape
            )  # the rank holding the loss stage
            dist.broadcast(loss, src=self.pp_ranks[last], group=self.mesh.pp_group)
        return loss

    def train_batch(
        self,
        data_iter,
        *,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        on_micro_batch: Callable[[], None] | None = None,
        sum_tied: bool = True,
    ) -> torch.Tensor:
        """One training step's forward and backward over ``m`` micro-batches.

        Args:
            data_iter: iterator of micro-batch dicts (``input_ids [b, s]``, ``labels [b, s]``,
                optional ``attention_mask``, ``position_ids``, ``token_type_ids``); every pipeline
                rank must yield the same m micro-batches (stage 0 reads ``input_ids``, the last
                stage ``labels``, the others only shapes).
            scale_loss: maps each micro-batch's loss (a scalar on the last stage) to what its backward
                differentiates; default ``loss / m`` (the mean-loss gradients). An engine passes
                ``ZeroOptimizer.scale_loss`` (``loss * loss_scale / GAS``, with ``m == GAS``).
            on_micro_batch: called once per micro-batch, when this rank's last backward action of it
                has run (e.g. ``ZeroOptimizer.note_micro_step``).
            sum_tied: sum the tied copies' ``.grad`` after the schedule (``sum_tied_gradients``); an
                engine whose ZeRO stage consumed ``.grad`` during backward passes False and sums the
                reduced gradients itself through ``sum_tied_gradients(grads)``.

        Returns:
            The mean over micro-batches of the micro-batch losses: a float32 tensor of shape ``[]``
            on the pipeline's device, on every rank (broadcast from the last stage; this
            data-parallel replica's loss). No host sync.

        Raises:
            ValueError: fewer than m micro-batches; a micro-batch without labels.
        """
        microbatches = self._pull(data_iter)
        self._refresh_dtype()
        measuring, timing = self._steps == self._measure_step, self.executor.time_compute
        self.executor.time_compute = timing or measuring
        try:
            losses = self.executor.run(
                self.actions,
                microbatches,
                train=True,
                scale_loss=scale_loss,
                on_micro_batch=on_micro_batch,
            )
        finally:
            self.executor.time_compute = timing
            self._steps += 1
        if measuring:
            self._plan_from(self.executor.timeline)
        if sum_tied:
            self.sum_tied_gradients()
        return self._mean_loss(losses)

    @torch.no_grad()
    def eval_batch(self, data_iter) -> torch.Tensor:
        """Forward only over m micro-batches (the schedule's forward order); returns the mean loss
        on every rank like ``train_batch``. Leaves ``.grad`` untouched; does not change
        ``train()``/``eval()`` modes (set them on the stage modules yourself)."""
        microbatches = self._pull(data_iter)
        self._refresh_dtype()
        return self._mean_loss(self.executor.run(self.eval_actions, microbatches, train=False))
