"""ZeRO-Offload: the host side of ``ZeroOptimizer`` (optimizer state, and stage-3 parameters, in host
memory), with the CPU optimizer step overlapped with backward and with the device copies.

Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC'21: per rank the
fp32 master shard, the fp32 gradient shard and the optimizer state (Adam: 16 bytes/param of the rank's
``1/dp`` partition) live on the host; the device keeps only the compute-dtype parameters (and with
``offload_param`` not even those between uses, Sec. 4 / ZeRO-Infinity's parameter offload).

Data path of one optimizer step (``G`` = one *segment*, the unit of gradient reduction; CUDA streams
in brackets; on a CPU-only machine every copy is a plain host copy and the streams do not exist)::

    backward                       side stream [d2h]               worker thread (numba, N threads)
    --------                       -----------------               ---------------------------------
    G reduce-scattered  ---------> copy G -> pinned host grad ---> (GAS>1: add into the host shard)
    (backward continues)                                           sum of squares of G (norm, overflow)
                                                                   early mode: CPU step of G now
    ...                                                            ...
    step(): all G landed -> norm all-reduced -> clip coefficient
                                                                   deferred mode: CPU step of each G
                                   [h2d] copy updated bf16 G  <--- (fused bf16/fp16 copy-out of the step)
                                         back to the device
    step() returns; next forward: per segment, a pre-hook waits for its copy (device waits on [h2d]
    event) and all-gathers its updated shard (dp > 1) right before first use

The host gradient shard is fp32, except with bf16 weights at GAS 1 (one rank, or a bf16 reduction):
then the reduced gradient is bf16 already and stays bf16 on the host (half the device->host bytes and
2 bytes/param less host memory); the kernels and the norm read it as is and widen it exactly.

Exactness of clipping and fp16 overflow (``step_mode``): every segment's squared gradient norm is
computed as it lands, overlapped with backward: at GAS 1 on the device before its copy to the host
(``clip.sum_squares64``: float64, an order fixed by the segment length, so the norm does not depend on
which side steps the segment), at GAS > 1 on the host once accumulated (numba, float64). At ``step()``
the global norm costs one scalar all-reduce; inf/nan anywhere makes it non-finite (fp16 overflow). The
CPU step of a segment needs the clip coefficient ``min(1, max_norm / norm) / loss_scale``, known only once
*every* segment has landed. Hence:

* **early** (``overlap_step`` on, ``max_grad_norm`` off, no fp16 loss scaler, so the coefficient is
  exactly 1, no device share, see ``plait.zero.offload.device_share``, and the non-finite guard off,
  since a segment stepped during backward cannot be skipped afterwards:
  ``ZeroOptimizer(precision=PrecisionOptions(skip_nonfinite=False))``, which applies an inf/nan norm as
  is on every path, ``ZeroOptimizer.step``): each segment is stepped by the worker as soon as it lands,
  while backward computes earlier layers, and its bf16 copy-back is queued right away. This is the full
  overlap of the ZeRO-Offload paper.
* **deferred** (clipping on, or fp16): the segments' CPU steps start at ``step()`` with the exact
  coefficient (no speculation, no use of a stale norm), in forward order, each followed at once by
  its non-blocking host->device copy, so copies overlap the next segment's CPU step; the device->host
  copies, the gradient accumulation and the norm partials already overlapped backward. A non-finite
  norm (fp16 overflow, a nan gradient in any precision) skips the step before any state is touched.

Overlap with the next forward (``OffloadOptions.overlap_step``, default on): ``step()`` returns once
the host steps are *queued*; it does not wait for them. Each segment's ticket (``plait.zero.offload.ready``)
is consumed right before the device first reads the segment: a forward pre-hook on every module
holding one of its parameters directly (stages 1-2, stage-3 persistent segments), or the stage-3
gatherer before it fetches a unit (``ParamGatherer.gate``). Consuming waits for the worker to have
queued the segment's copy-back (host), makes the compute stream wait on that copy's event (device, no
host sync) and, at dp > 1 where ranks hold parameters whole, all-gathers the updated shards of the
segments consumed (in step order, at the same hooks on every rank, so the collectives match). So the
host step of layer ``L+1`` runs while the GPU computes layer ``L`` of the next forward, and the values
read are exactly those of a synchronous step. Everything else that reads parameters, masters or
optimizer state, or writes gradients, first waits for the whole step (``synchronize``): the next
backward, the next ``step``, ``zero_grad``, ``write_back``, ``gathered_parameters``, ``shard_state``
(checkpoint saves), ``load_shard_state``, ``close``. Stage-3 prefetch skips segments not yet consumed
(they are fetched on demand). Limit: a parameter read by code outside the forward of every module that
holds it (``F.linear(x, other_module.weight)``) is not waited for: call ``ZeroOptimizer.synchronize()``
first or turn ``overlap_step`` off. The worker steps segments in module registration order
(``ready.forward_order``), a proxy for forward order; a different order is still exact.

Results equal the non-offloaded ``ZeroOptimizer`` stepping with the same kernels bit for bit: both
take the clip coefficient from a float64 norm (``clip.global_grad_norm``) and multiply the float32
gradient by it (``tests/test_offload.py``). Against torch's Adam/AdamW the kernels agree to float32
rounding per step (~1e-7; ``tests/test_kernels.py``).

Gradient accumulation (GAS > 1): reduced gradients of earlier micro-steps are accumulated in the host
fp32 gradient shard (first landing copies, later ones add; no fp32 gradient buffer on the device);
only landings of the last micro-step (``micro_steps + 1 == GAS`` during backward; stage 1 reduces at
the boundary) compute norms or step. Segments not yet finalized at ``step()`` (e.g. a pipeline engine
counting micro-steps after its schedule) are finalized there.

Pipelines (``OffloadOptions.final_at_step``, set by the engine for a ``PipelineParallel``): a pipeline
engine edits the gradients after backward -- it sums the tied embedding copies' gradients (first and last
stage) after its schedule, in the host gradient shards at stages 2-3, once the worker's landings are in
(``plait.engine.pipeline.settle_landings``) -- and interleaved chunks land a segment once per chunk backward.
So no landing is taken as final: every norm is computed on the host at ``step()`` and the host steps run in
deferred mode (still overlapped with the next forward); no early mode, no device-side norms at GAS 1 and no
device share (``device_step_fraction`` must be 0). Stage 1 keeps gradients in ``.grad`` until ``step()``
reduces them, so the tied sum happens before anything lands.

Optimizer states in less than fp32 (``optimizer.params.state_dtype`` "bf16" or "int8"; DeepSpeed's
``bf16.bf16_optimizer_states``): the host kernels read and write the moments in that form in the same pass
(``plait.kernels.cpu_adam_states``; 8-bit blocks start at every segment and parameter piece, so a segment
step never shares a block), resident masters (``ratio`` < 1) step the same store with torch ops
(``device_states``), and a streamed device share (``device_step_fraction``) is not offered for them.
Checkpoints hold the moments as float32 values under torch's names (``HostOptimizer.checkpoint_state``).

Early mode caveat: once the last micro-step's backward ran, the host step of each segment is already
applied; ``zero_grad()`` then cannot discard it (``step()`` completes it). Use deferred mode
(``OffloadOptions(overlap_step=False)``) if a step may be abandoned after backward.
"""
from plait.zero.offload.gatherer import OffloadGatherer
from plait.zero.offload.host import HostStepper
from plait.zero.offload.optim import HostOptimizer, host_optimizer, is_host_optimizer
from plait.zero.offload.options import OffloadOptions
from plait.zero.offload.ready import Readiness, forward_order

__all__ = ["HostOptimizer", "HostStepper", "OffloadGatherer", "OffloadOptions", "Readiness", "forward_order",
           "host_optimizer", "is_host_optimizer"]
