"""``HostOptimizer``: a torch optimizer over ZeRO's flat fp32 master shards that steps on the host
with plait's numba kernels (``plait.kernels``), one bucket (range) at a time (ZeRO-Offload, Ren et
al., USENIX ATC'21, Sec. 4). ``ZeroOptimizer`` holds it as ``.optimizer`` when ``offload`` is on;
``state[master]`` keeps torch's names (``step``, ``exp_avg``, ``exp_avg_sq``), so checkpoints are the
same with offload on or off.

Kinds: ``"adamw"`` (torch.optim.AdamW), ``"adam"`` (L2 weight decay, torch.optim.Adam), ``"lion"``
(Chen et al. 2023, Alg. 2). LAMB is not offered (its per-tensor norms span ranks; ``docs/offload.md``).

Stepping (``plait.zero.offload.HostStepper`` drives it)::

    host.begin_step()                                 # every master: step += 1, hyper-parameters read
    host.step_range(i, offset, length, grad, lowp_out, grad_coef)  # any order, each range once
"""

from __future__ import annotations

import functools

import torch

from plait.kernels import CPUAdam, CPUAdamStates, CPULion
from plait.kernels.quant import check_state_dtype
from plait.zero.offload.device_states import state_update_

KINDS = ("adam", "adamw", "lion")
_IGNORED = (
    "foreach",
    "fused",
    "capturable",
    "differentiable",
)  # torch options with no meaning here


class HostOptimizer(torch.optim.Optimizer):
    """Adam / AdamW / Lion over host fp32 flat tensors (see module docstring).

    Args:
        params: torch-style params or param groups; every tensor must be a contiguous float32 1-D tensor
            (a ZeRO master shard ``[shard_numel]``) in host memory, or for Adam/AdamW in device memory (a
            master the placement keeps there, ``plait.zero.offload.placement``: its moments are allocated
            beside it and ``DeviceShare`` steps it; ``step_range`` steps host masters only).
        kind: "adamw", "adam" or "lion".
        lr, betas, eps, weight_decay, bias_correction: per-group defaults, as in torch (eps and
            bias_correction are ignored by Lion).
        num_threads: numba threads per kernel call (None: numba's pool size).
        state_dtype: how Adam/AdamW store their moments: "fp32" (``CPUAdam``), "bf16" or "int8" (8-bit blocks,
            ``CPUAdamStates``; ``plait.kernels.quant``); the masters stay fp32.
        boundaries: int8: per master, the element offsets where a quantization block must start (ZeRO passes
            each segment's and each parameter piece's start: ``plait.zero.build.block_boundaries``); the
            ranges stepped must be unions of whole blocks. None: blocks of 256 from 0.
        amsgrad, maximize: accepted for torch compatibility; True raises.

    A master in device memory is stepped with torch ops on the same moment store
    (``plait.zero.offload.device_states``): the non-offloaded ZeRO path with ``state_dtype`` bf16/int8.

    Raises:
        ValueError: unknown kind or state_dtype, a non-CPU/non-float32 parameter, amsgrad or maximize set,
            Lion with a state_dtype other than fp32.
    """

    def __init__(
        self,
        params,
        kind: str = "adamw",
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        bias_correction: bool = True,
        num_threads: int | None = None,
        amsgrad: bool = False,
        maximize: bool = False,
        state_dtype: str = "fp32",
        boundaries=None,
        **torch_options,
    ):
        if kind not in KINDS:
            raise ValueError(f"HostOptimizer kind {kind!r} is not one of {KINDS}")
        check_state_dtype(state_dtype)
        if kind == "lion" and state_dtype != "fp32":
            raise ValueError(
                f"optimizer.params.state_dtype = {state_dtype!r} is served for Adam/AdamW only; Lion keeps "
                "its fp32 momentum: remove state_dtype"
            )
        unknown = sorted(set(torch_options) - set(_IGNORED) - {"decoupled_weight_decay"})
        if amsgrad or maximize or unknown:
            raise ValueError(
                f"the offloaded CPU optimizer does not support amsgrad={amsgrad}, maximize={maximize} "
                f"or options {unknown}; remove them or turn offload_optimizer off"
            )
        if torch_options.get("decoupled_weight_decay") and kind == "adam":
            kind = "adamw"
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
        }
        super().__init__(params, defaults)
        self.kind, self.num_threads, self.state_dtype = kind, num_threads, state_dtype
        self.boundaries = boundaries or {}
        self.kernels: dict[torch.Tensor, object] = {}
        for group in self.param_groups:
            for p in group["params"]:
                on_host = p.device.type == "cpu" or kind != "lion"
                if not on_host or p.dtype != torch.float32 or not p.is_contiguous() or p.dim() != 1:
                    raise ValueError(
                        f"HostOptimizer steps contiguous 1-D float32 tensors (CPU ones for Lion); got "
                        f"{p.dtype} {tuple(p.shape)} on {p.device}"
                    )
                self.kernels[p] = self._make_kernel(p, group)

    def _make_kernel(self, p: torch.Tensor, group: dict):
        if self.kind == "lion":
            return CPULion(
                p,
                lr=group["lr"],
                betas=group["betas"],
                weight_decay=group["weight_decay"],
                num_threads=self.num_threads,
            )
        kw = dict(
            lr=group["lr"],
            betas=group["betas"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            adamw_mode=self.kind == "adamw",
            bias_correction=group["bias_correction"],
            num_threads=self.num_threads,
        )
        if self.state_dtype == "fp32":
            return CPUAdam(p, **kw)
        return CPUAdamStates(
            p, **kw, state_dtype=self.state_dtype, boundaries=self.boundaries.get(p, (0,))
        )

    def _hparams(self, group: dict) -> dict:
        hp = {
            "lr": group["lr"],
            "beta1": group["betas"][0],
            "beta2": group["betas"][1],
            "weight_decay": group["weight_decay"],
        }
        if self.kind != "lion":
            hp.update(
                eps=group.get("eps", 1e-8),
                adamw_mode=self.kind == "adamw",
                bias_correction=group.get("bias_correction", True),
            )
        return hp

    def _link_state(self, p: torch.Tensor) -> None:
        k = self.kernels[p]
        st = {"step": torch.tensor(float(k.step_count), dtype=torch.float32)}
        st.update({n: getattr(k, n) for n in k._state_names})
        st.update(
            {
                n + "_absmax": getattr(k, n + "_absmax")
                for n in k._state_names
                if hasattr(k, n + "_absmax")
            }
        )
        self.state[p] = st

    # ---- stepping --------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start one optimizer step for every master: read each group's hyper-parameters (an LR
        schedule may have changed them), advance the step counters (bias correction)."""
        for group in self.param_groups:
            for p in group["params"]:
                k = self.kernels[p]
                k._set_hparams(self._hparams(group))
                k.begin_step(group["lr"])
                self._link_state(p)

    def step_range(
        self,
        p: torch.Tensor,
        offset: int,
        length: int,
        grad: torch.Tensor,
        lowp_out: torch.Tensor | None = None,
        grad_coef: float = 1.0,
    ) -> None:
        """Update elements ``[offset, offset+length)`` of master ``p`` (``[numel]`` fp32) from ``grad``
        (fp32, ``[numel]`` or ``[length]``), multiplying the gradient by ``grad_coef``; write the
        rounded bf16/fp16 weights into ``lowp_out`` (``[length]``) in the same pass when given. A master in
        device memory is stepped with torch ops (``device_states.state_update_``)."""
        k = self.kernels[p]
        if p.device.type == "cpu":
            k.step_range(p.detach(), grad, offset, length, lowp_out=lowp_out, grad_coef=grad_coef)
            return
        if k._step_lr is None:
            raise RuntimeError(
                "call begin_step() before step_range(): it advances the step counter once per step"
            )
        w = p.detach()[offset : offset + length]
        state_update_(
            k,
            w,
            grad[offset : offset + length] if grad.numel() != length else grad,
            offset,
            length,
            grad_coef,
        )
        if lowp_out is not None:
            lowp_out.copy_(w)

    @torch.no_grad()
    def step(self, closure=None):
        """torch API: one whole step of every master that has a ``.grad``."""
        loss = closure() if closure is not None else None
        self.begin_step()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.step_range(p, 0, p.numel(), p.grad.float().contiguous())
        return loss

    # ---- checkpoints ------------------------------------------------------------------------------
    def checkpoint_state(self, p: torch.Tensor) -> dict:
        """``state[p]`` as a checkpoint stores it: ``step`` and the moments as float32 ``[numel]`` under torch's
        names whatever ``state_dtype`` stores them in (dequantized copies for bf16/int8); {} before any step."""
        st = self.state.get(p, {})
        k = self.kernels[p]
        if not st or not hasattr(k, "moment"):
            return st
        return {"step": st["step"], **{n: k.moment(n) for n in k._state_names}}

    def state_dict(self) -> dict:
        """torch API; bf16/int8 moments as float32 values (``checkpoint_state``), which ``load_state_dict`` takes."""
        sd = super().state_dict()
        if self.state_dtype != "fp32":
            order = [p for g in self.param_groups for p in g["params"]]
            sd["state"] = {
                i: self.checkpoint_state(p) for i, p in enumerate(order) if p in self.state
            }
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """torch API; the loaded moments are copied into the kernels' buffers (missing: zero)."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for p in group["params"]:
                k, st = self.kernels[p], self.state.get(p, {})
                for n in (
                    k._state_names
                ):  # float32 values, stored in this state_dtype (converted by name)
                    values = (
                        st[n].reshape(-1).to(torch.float32) if n in st else torch.zeros(k.numel)
                    )
                    if hasattr(k, "set_moment"):
                        k.set_moment(n, values.to(getattr(k, n).device))
                    else:
                        getattr(k, n).copy_(values)
                k.step_count = int(float(st.get("step", 0)))
                k._set_hparams(self._hparams(group))
                k.lr = float(group["lr"])
                if st:
                    self._link_state(p)
                else:
                    self.state.pop(p, None)


def is_host_optimizer(factory) -> bool:
    """Whether ``factory`` is ``HostOptimizer`` or a ``functools.partial`` of it."""
    return (factory.func if isinstance(factory, functools.partial) else factory) is HostOptimizer


def host_optimizer(factory, num_threads: int | None = None):
    """The ``HostOptimizer`` factory standing in for a torch optimizer ``factory`` under offload.

    ``torch.optim.AdamW`` -> kind "adamw"; ``torch.optim.Adam`` -> "adam" (L2 decay; DeepSpeed's
    ``adam_w_mode: false``) or "adamw" with ``decoupled_weight_decay=True``; ``HostOptimizer`` or a
    ``functools.partial`` of it -> itself. ``num_threads`` is applied unless the factory sets it.

    Raises:
        ValueError: any other optimizer (names it and the supported ones).
    """
    base = factory.func if isinstance(factory, functools.partial) else factory
    if base is HostOptimizer:
        keywords = dict(factory.keywords) if isinstance(factory, functools.partial) else {}
        keywords.setdefault("num_threads", num_threads)
        return functools.partial(HostOptimizer, **keywords)
    if factory is torch.optim.AdamW:
        return functools.partial(HostOptimizer, kind="adamw", num_threads=num_threads)
    if factory is torch.optim.Adam:
        return functools.partial(HostOptimizer, kind="adam", num_threads=num_threads)
    name = getattr(base, "__name__", type(base).__name__)
    raise ValueError(
        f"optimizer {name} cannot run offloaded: the CPU optimizers are Adam, AdamW and Lion "
        "(pass torch.optim.Adam/AdamW or functools.partial(plait.zero.offload.HostOptimizer, "
        "kind='lion')), or turn offload_optimizer off"
    )
