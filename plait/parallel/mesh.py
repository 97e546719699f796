"""ParallelMesh: the (pp, dp, cp, tp) grid of ranks and its process groups.

Rank layout follows Megatron-LM and torchtitan: tp varies fastest, then cp (context parallel), then dp,
then pp. For world size W = pp*dp*cp*tp, global rank r sits at
``(pp_rank, dp_rank, cp_rank, tp_rank) = (r // (dp*cp*tp), (r // (cp*tp)) % dp, (r // tp) % cp, r % tp)``.
ZeRO shards and reduces over ``group("dp_cp")`` (the dp group when cp = 1). Expert parallelism splits the dp
ranks: ``ep`` divides ``dp``, ``dp_rank = edp_rank * ep + ep_rank``, and an expert's parameters are
replicated over ``group("edp")`` (``dp`` when ``ep = 1``).

The mesh is an ordinary object passed explicitly to every layer, optimizer and schedule that needs it;
plait keeps no module-level process-group state. Why this order and these groups:
``docs/tensor-parallel.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DIM_NAMES = ("pp", "dp", "cp", "tp")
GROUP_NAMES = DIM_NAMES + ("dp_cp", "ep", "edp")


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending (the valid sizes to name in an error)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divisible(value: int, divisor: int, what: str, by: str, fix: str) -> None:
    """Raise ValueError naming both numbers when ``value % divisor != 0``."""
    if divisor <= 0 or value % divisor != 0:
        raise ValueError(f"{what} ({value}) is not divisible by {by} ({divisor}); {fix}")


@dataclass
class ParallelMesh:
    """Tensor x context x data x pipeline parallel grid over ``torch.distributed.device_mesh``.

    Args:
        tp: tensor-parallel size (ranks that split each layer's weights).
        pp: pipeline-parallel size (ranks that split the layer list into stages).
        dp: data-parallel size; inferred as ``world_size // (tp*pp*cp)`` when None.
        cp: context-parallel size (ranks that split each sequence).
        ep: expert-parallel size (ranks that split each mixture-of-experts layer's experts); divides dp.
        device_type: "cpu" (gloo) or "cuda" (NCCL); defaults from the backend.

    With no process group initialized and ``tp = pp = dp = cp = 1`` the mesh is a
    single-process mesh: every group is None and every rank is 0, so the same
    model code runs as a plain ``nn.Module``.

    Raises:
        ValueError: world size not divisible by ``tp*pp*cp``, ``tp*pp*cp*dp`` not equal to the world
            size, or dp not divisible by ep; the message names the numbers and the fix.
    """

    tp: int = 1
    pp: int = 1
    dp: int | None = None
    cp: int = 1
    ep: int = 1
    device_type: str | None = None
    device_mesh: object = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        world = dist.get_world_size() if dist.is_initialized() else 1
        split = self.tp * self.pp * self.cp
        check_divisible(
            world,
            split,
            "world size",
            f"tp x pp x cp = {self.tp} x {self.pp} x {self.cp}",
            "launch a multiple of tp*pp*cp processes or change tp/pp/cp",
        )
        inferred = world // split
        if self.dp is None:
            self.dp = inferred
        elif self.dp != inferred:
            raise ValueError(
                f"tp x pp x cp x dp = {self.tp} x {self.pp} x {self.cp} x {self.dp} = {split * self.dp} "
                f"but the world size is {world}; set dp={inferred} or leave dp unset to infer it"
            )
        check_divisible(
            self.dp,
            self.ep,
            "dp",
            "ep",
            f"expert parallelism splits the dp ranks: choose ep from {divisors(self.dp)}",
        )
        if (
            not dist.is_initialized()
        ):  # one process, no group: compute where a GPU is, as DeepSpeed does
            if self.device_type is None:
                self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
            return
        if self.device_type is None:
            self.device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
        from torch.distributed.device_mesh import init_device_mesh

        if self.ep == 1:
            self.device_mesh = init_device_mesh(
                self.device_type, (self.pp, self.dp, self.cp, self.tp), mesh_dim_names=DIM_NAMES
            )
            dp = ("dp",)
        else:  # dp split into (edp, ep), ep fastest; "dp" is their flattening
            shape = (self.pp, self.dp // self.ep, self.ep, self.cp, self.tp)
            self.device_mesh = init_device_mesh(
                self.device_type, shape, mesh_dim_names=("pp", "edp", "ep", "cp", "tp")
            )
            dp = ("edp", "ep")
            self.device_mesh[dp]._flatten("dp")
        if self.cp > 1:
            self.device_mesh[dp + ("cp",)]._flatten("dp_cp")

    # ---- groups, ranks and sizes per dim -------------------------------------------------
    def group(self, dim: str):
        """ProcessGroup of this rank along ``dim`` ("tp", "pp", "dp", "cp", "dp_cp", "ep" or "edp"); None in one
        process, and for "ep" without expert parallelism."""
        if dim not in GROUP_NAMES:
            raise ValueError(f"unknown mesh dim {dim!r}; expected one of {GROUP_NAMES}")
        if dim == "dp_cp" and self.cp == 1 or dim == "edp" and self.ep == 1:
            dim = "dp"
        if self.device_mesh is None or dim == "ep" and self.ep == 1:
            return None
        return self.device_mesh.get_group(dim)

    def size(self, dim: str) -> int:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "cp": self.cp,
            "dp_cp": self.dp * self.cp,
            "ep": self.ep,
            "edp": self.dp // self.ep,
        }[dim]

    def rank(self, dim: str) -> int:
        """This process's coordinate along ``dim`` (``dp_cp``: ``dp_rank * cp + cp_rank``; ``dp``:
        ``edp_rank * ep + ep_rank``)."""
        if self.device_mesh is None or dim == "ep" and self.ep == 1:
            return 0
        if dim == "dp_cp":
            return self.rank("dp") * self.cp + self.rank("cp")
        if self.ep > 1 and dim == "dp":
            return self.rank("edp") * self.ep + self.rank("ep")
        if dim == "edp" and self.ep == 1:
            dim = "dp"
        return self.device_mesh.get_local_rank(dim)

    def ranks(self, dim: str) -> list[int]:
        """Global ranks of this process's group along ``dim``, in group-rank order."""
        group = None if self.device_mesh is None else self.group(dim)
        if group is None:
            return [self.global_rank]
        return dist.get_process_group_ranks(group)

    def new_column_group(self, select=lambda column: column):
        """A process group per pipeline column: for every (dp, cp, tp) coordinate, the group of the ranks
        ``select(column)`` picks from its pp ranks (global ranks, pp order), e.g. ``lambda c: [c[0], c[-1]]``
        for the first and last stage. Collective over the world (every rank creates every group, in the same
        order). Returns this rank's group, or None when it is in none."""
        grid = self.device_mesh.mesh  # [pp, dp, cp, tp] global ranks
        columns = grid.reshape(grid.shape[0], -1)
        mine = None
        for c in range(columns.shape[1]):
            ranks = select([int(r) for r in columns[:, c]])
            group = dist.new_group(ranks)
            if self.global_rank in ranks:
                mine = group
        return mine

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def global_rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    tp_group = property(lambda self: self.group("tp"))
    pp_group = property(lambda self: self.group("pp"))
    dp_group = property(lambda self: self.group("dp"))
    cp_group = property(lambda self: self.group("cp"))
    cp_rank = property(lambda self: self.rank("cp"))
    tp_rank = property(lambda self: self.rank("tp"))
    pp_rank = property(lambda self: self.rank("pp"))
    dp_rank = property(lambda self: self.rank("dp"))
    ep_group = property(lambda self: self.group("ep"))
    ep_rank = property(lambda self: self.rank("ep"))

    @property
    def is_first_stage(self) -> bool:
        """Whether this rank holds pipeline stage 0 (every placement)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank is the last pipeline rank: the loss end under one chunk per rank or the "loop"
        placement; under "zb-v" rank 0 holds the last stage (``plait.parallel.pipeline.schedules.stage_of``)."""
        return self.pp_rank == self.pp - 1

    @property
    def device(self) -> torch.device:
        """The device this rank computes on: the local CUDA device under NCCL, else CPU."""
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def __repr__(self) -> str:
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        return (
            f"ParallelMesh(tp={self.tp}, pp={self.pp}, dp={self.dp}, cp={self.cp}{ep}, rank={self.global_rank}, "
            f"coords=(pp={self.pp_rank}, dp={self.dp_rank}, cp={self.cp_rank}, tp={self.tp_rank}))"
        )
