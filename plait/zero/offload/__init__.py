"""ZeRO-Offload: the host side of ``ZeroOptimizer`` (Ren et al., "ZeRO-Offload: Democratizing
Billion-Scale Model Training", USENIX ATC'21; stage-3 parameter offload: ZeRO-Infinity, SC'21).

Per rank the fp32 master shard, the gradient shard and the optimizer state (Adam: 16 bytes/param of the
rank's ``1/dp`` partition) live in host memory; the CPU step of each gradient segment overlaps backward
(early mode) or the next forward (deferred mode, with clipping or fp16), and results equal the
non-offloaded ``ZeroOptimizer`` bit for bit.

Entry points: ``OffloadOptions`` (what moves to the host), ``HostStepper`` (the stepper ``ZeroOptimizer``
drives), ``HostOptimizer`` / ``host_optimizer`` (the torch optimizer over the host masters),
``OffloadGatherer`` (stage-3 parameters from host memory), ``Readiness`` / ``forward_order`` (per-segment
tickets the next forward waits on). The data path, the two step modes, the overlap with the next forward
and their limits: ``docs/offload.md``.
"""

from plait.zero.offload.gatherer import OffloadGatherer
from plait.zero.offload.host import HostStepper
from plait.zero.offload.optim import HostOptimizer, host_optimizer, is_host_optimizer
from plait.zero.offload.options import OffloadOptions
from plait.zero.offload.ready import Readiness, forward_order

__all__ = [
    "HostOptimizer",
    "HostStepper",
    "OffloadGatherer",
    "OffloadOptions",
    "Readiness",
    "forward_order",
    "host_optimizer",
    "is_host_optimizer",
]
