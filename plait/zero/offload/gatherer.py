"""Stage-3 parameter offload (ZeRO-Infinity's parameter offload, Rajbhandari et al., SC'21, Sec. 5):
the rank's compute-dtype parameter shards live in (pinned) host memory between uses."""
from __future__ import annotations

import torch

from plait.zero.comm import gather_segments
from plait.zero.flat import Segment
from plait.zero.stage3 import ParamGatherer


class OffloadGatherer(ParamGatherer):
    """Stage-3 gatherer whose parameter shards (``Segment.local``, ``[S]``) live on the host: each fetch
    copies the shards to ``device`` (non-blocking from pinned memory, on the current stream) and
    all-gathers them there into ``[padded]`` buffers. Same arguments as ``ParamGatherer`` plus ``device``."""

    def __init__(self, *args, device: torch.device, **kwargs):
        self.device = torch.device(device)
        super().__init__(*args, **kwargs)

    def _fetch(self, segs: list[Segment], async_op: bool) -> None:
        if not segs:
            return
        self.stats["prefetched" if async_op else "fetched"] += len(segs)
        outs = [torch.empty(s.padded, dtype=s.local.dtype, device=self.device) for s in segs]
        ins = [s.local.to(self.device, non_blocking=True) for s in segs]
        launched = gather_segments(outs, ins, self.dp_group, self.dp_size, self.allgather_bucket_size,
                                   async_op=async_op)
        if not async_op or not launched:
            for s, out in zip(segs, outs):
                s.set_views(out)
            return
        for pending, run in launched:
            pending.keep.extend(ins[k] for k in run)
            record = (pending, [segs[k] for k in run], [outs[k] for k in run])
            for k in run:
                self.in_flight[id(segs[k])] = record
