"""``OffloadOptions``: what ``ZeroOptimizer(offload=...)`` moves to the host (ZeRO-Offload, Ren et al.,
USENIX ATC'21, Sec. 4; stage-3 parameter offload: ZeRO-Infinity, Rajbhandari et al., SC'21)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OffloadOptions:
    """What ``ZeroOptimizer(offload=...)`` moves to the host.

    Args:
        optimizer: fp32 masters, gradient shards and optimizer state on the host; the optimizer
            (``HostOptimizer``: Adam/AdamW/Lion) steps there. Stages 1-3.
        param: stage 3: compute-dtype parameter shards on the host between uses (copied to the device
            right before each unit's all-gather).
        pin_memory: page-lock the buffers that cross the bus (fp32 gradient shard, bf16/fp16 copy-out,
            stage-3 parameter shards) when CUDA is available; needed for asynchronous copies.
        num_threads: numba threads of the CPU optimizer (None: numba's pool, i.e. every core).
        overlap_step: overlap the host step with the device (``plait.zero.offload``): ``step()`` returns
            before the host step ends and the next forward waits per segment; and where the clip
            coefficient is exactly 1 and no device share is taken (early mode) segments are stepped during
            backward as they land.
            False: ``step()`` steps every segment after backward and waits for all of them.
        device_step_fraction: in [0, 1): the first this fraction of the optimizer partition (elements, in
            forward order) is updated by the device from the host-resident states while the CPU steps
            the rest (``plait.zero.offload.device_share``); 0: everything on the CPU. ``"auto"``: after
            every step, move the split towards equal CPU and device times (exact either way). Adam/AdamW,
            GAS 1, weights on the device. None (default): ``"auto"`` where the module is on a CUDA device,
            those conditions hold and ``pin_memory`` is on, else 0. Device memory: the share x the
            partition x 4 bytes (fp32 reduced gradients kept until the step); ``docs/offload.md``.
        ratio: the fraction, in [0, 1], of the optimizer partition (elements) whose fp32 masters and Adam
            moments live in host memory (DeepSpeed's ``offload_optimizer.ratio``); the first ``1 - ratio`` in
            forward order keep theirs in device memory for the whole run and are stepped there, with the same
            roundings as the host kernels (``plait.zero.offload.placement``). 1 (default): all on the host.
            Below 1: Adam/AdamW, compute weights on the device (no ``param``), no pipeline (``final_at_step``).
        final_at_step: the gradients are final only at ``step()``, not when backward lands them (a
            pipeline's tied-gradient sum, interleaved chunks): norms and host steps start at ``step()``
            (deferred mode); no early steps, no device share. The engine sets it for pipelines; why:
            ``docs/offload.md``, "Gradient accumulation and pipelines".

    Raises:
        ValueError: ``device_step_fraction`` neither None, "auto" nor in [0, 1); ``ratio`` not in [0, 1].
    """

    optimizer: bool = True
    param: bool = False
    pin_memory: bool = True
    num_threads: int | None = None
    overlap_step: bool = True
    device_step_fraction: float | str | None = None
    final_at_step: bool = False
    ratio: float = 1.0

    @property
    def adaptive(self) -> bool:
        """``device_step_fraction == "auto"`` written out (the default may become "auto" on a GPU:
        ``HostStepper``)."""
        return self.device_step_fraction == "auto"

    def __post_init__(self):
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0.0 <= r <= 1.0:
            raise ValueError(
                f"offload ratio={r!r} must be a number in [0, 1] (the share of the optimizer states in "
                "host memory; 1 = all of them)"
            )
        f = self.device_step_fraction
        number = isinstance(f, (int, float)) and not isinstance(f, bool) and 0.0 <= f < 1.0
        if f is not None and not self.adaptive and not number:
            raise ValueError(
                f"device_step_fraction={self.device_step_fraction} must be in [0, 1) (the share of the "
                "optimizer step the device computes; 0 = all on the CPU)"
            )
