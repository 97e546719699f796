"""plait's parallel sections of the ds_config: ``tensor_parallel``, ``context_parallel`` and ``pipeline``
(DeepSpeed's ``pipeline.stages`` spelling is read too). Importable from :mod:`plait.config.schema`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plait.config.schema_base import ConfigError, bounded


@dataclass(frozen=True)
class TensorParallelConfig:
    """``tensor_parallel``: ``size`` ranks split each layer's weights (Shoeybi et al. 2019);
    ``sequence_parallel`` also splits norms/dropout activations along the sequence (Korthikanti et al. 2022)."""

    size: int = bounded(1, ge=1)
    sequence_parallel: bool = False


CP_METHODS = ("ring", "all_to_all")


@dataclass(frozen=True)
class ContextParallelConfig:
    """``context_parallel``: ``size`` ranks split each sequence (``plait.parallel.context``); ``method``
    "ring" (ring attention, Liu et al. 2023) or "all_to_all" (DeepSpeed-Ulysses, Jacobs et al. 2023). The
    model must be built with the same method (``TransformerModel(..., cp_method=...)``)."""

    size: int = bounded(1, ge=1)
    method: Literal["ring", "all_to_all"] = "ring"

    def __post_init__(self) -> None:
        if self.method not in CP_METHODS:
            raise ConfigError(f"context_parallel.method {self.method!r} is not one of {CP_METHODS}")


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")


@dataclass(frozen=True)
class PipelineConfig:
    """``pipeline``: ``size`` stages (DeepSpeed's spelling ``stages`` is accepted too).

    ``schedule``: "gpipe" (Huang et al. 2019), "1f1b" (PipeDream-Flush, Narayanan et al. 2021),
    "interleaved" (1F1B with ``virtual_stages`` model chunks per rank, Narayanan et al. SC'21 Sec. 2.2), or
    "zb-h1" (zero-bubble H1, Qi et al. 2024), or "zb-v" (zero-bubble V, Qi et al. NeurIPS 2024: ``virtual_stages``
    2 in the V placement, ``plait.parallel.pipeline.zb_v.zb_v``). ``micro_batches`` per optimizer step equals
    gradient_accumulation_steps (filled in by the reader). ``partition``: "uniform" (equal layer counts),
    "parameters" (balanced parameter counts), or explicit boundaries ``[0, b1, ..., n_layers]``: one more
    layer index than model chunks (``size * virtual_stages``), chunk i holding layers ``[b_i, b_{i+1})``.
    ``schedule_costs`` (zb-v only): "unit" plans the lists for equal action times (the paper's setting),
    "measure" plans them again after timing the second step (``PipelineParallel(schedule_costs="measure")``).
    ``cuda_graphs``: replay each training action as a CUDA graph (``PipelineParallel(cuda_graphs=True)``,
    ``plait.parallel.pipeline.graphs``; Megatron-LM's ``--enable-cuda-graph`` for pipeline actions): for small
    micro-batches, where issuing kernels from Python sets the pace. Needs tensor_parallel.size 1 and ZeRO
    stage 0-2 (ZeRO-3 gathers parameters in hooks a graph cannot replay).
    """

    size: int = bounded(1, ge=1, aliases=("stages",))
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"] = "1f1b"
    virtual_stages: int = bounded(1, ge=1)
    micro_batches: int | None = bounded(None, ge=1)
    partition: Literal["uniform", "parameters"] | list[int] = "uniform"
    schedule_costs: Literal["unit", "measure"] = "unit"
    cuda_graphs: bool = False

    @property
    def num_chunks(self) -> int:
        """Model chunks over all ranks: ``size * virtual_stages``."""
        return self.size * self.virtual_stages

    def __post_init__(self) -> None:
        if self.schedule == "interleaved" and self.virtual_stages < 2:
            raise ConfigError(
                f"pipeline.schedule 'interleaved' needs virtual_stages >= 2, got "
                f"{self.virtual_stages}; set virtual_stages or use schedule '1f1b'"
            )
        if self.schedule == "zb-v" and self.virtual_stages != 2:
            raise ConfigError(
                f"pipeline.schedule 'zb-v' runs virtual_stages = 2 (two chunks per rank in a V), got "
                f"{self.virtual_stages}; set virtual_stages: 2"
            )
        if self.schedule not in ("interleaved", "zb-v") and self.virtual_stages != 1:
            raise ConfigError(
                f"pipeline.virtual_stages = {self.virtual_stages} needs schedule 'interleaved' (or "
                f"'zb-v' with 2), got {self.schedule!r}"
            )
        if self.schedule_costs == "measure" and self.schedule != "zb-v":
            raise ConfigError(
                f"pipeline.schedule_costs 'measure' plans schedule 'zb-v' only, got "
                f"{self.schedule!r}; drop schedule_costs or use schedule 'zb-v'"
            )
        if isinstance(self.partition, list):
            b, chunks = self.partition, self.num_chunks
            if len(b) != chunks + 1 or b[0] != 0 or any(x >= y for x, y in zip(b, b[1:])):
                raise ConfigError(
                    f"pipeline.partition boundaries {b} must be {chunks + 1} strictly increasing "
                    f"layer indices starting at 0 (size {self.size} x virtual_stages "
                    f"{self.virtual_stages} = {chunks} chunks), e.g. [0, 4, 8] for 2 chunks of "
                    "4 layers"
                )
