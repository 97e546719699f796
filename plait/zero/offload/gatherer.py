"""Stage-3 parameter offload (ZeRO-Infinity's parameter offload, Rajbhandari et al., SC'21, Sec. 5):
the rank's compute-dtype parameter shards live in (pinned) host memory between uses."""

from __future__ import annotations

import torch

from plait.zero.flat import Segment
from plait.zero.stage3 import ParamGatherer


class OffloadGatherer(ParamGatherer):
    """Stage-3 gatherer whose parameter shards (``Segment.local``, ``[S]``) live on the host: each fetch
    copies the shards to ``device`` (non-blocking from pinned memory, on the current stream) and
    all-gathers them there into the ``[padded]`` buffers. Same arguments as ``ParamGatherer``, whose
    ``device`` is required here."""

    def __init__(self, *args, device: torch.device, **kwargs):
        super().__init__(*args, device=torch.device(device), **kwargs)

    def _sources(self, segs: list[Segment]) -> list[torch.Tensor]:
        return [s.local.to(self.device, non_blocking=True) for s in segs]
