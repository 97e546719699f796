"""The Hugging Face Trainer on one GPU or one node: plait (``plait.hf``) against DeepSpeed and FSDP2 under the same
Trainer script, in the same run.

    python benchmarks/bench_hf_trainer.py [--arms plait-z2-offload,ds-z2-offload,plait-z3,fsdp2]
        [--steps 8] [--warmup 3] [--out results.jsonl] [--nproc 1] [--size 7.2b]

Model: an unmodified ``transformers.LlamaForCausalLM`` of TinyLlama's shape (hidden 2048, 22 layers, 32 heads,
4 kv heads, ffn 5632, vocab 32000: 1.1B parameters), built from its config, sequence 2048, bf16,
AdamW (lr 1e-4, weight decay 0.1), clip 1.0; random tokens; ``--size`` builds the arms at one of
``_offload_arm.SIZES`` instead (``7.2b``: Llama-3-8B's layers with vocabulary 32000). Arms (each launched with
torchrun, ``--nproc`` processes of one node, data-parallel, micro-batch per rank):

* ``plait-z2-offload``: ``from plait.hf import Trainer, TrainingArguments``, ZeRO-2 + offload_optimizer
  (the seed's ``examples/configs/zero2_offload_hf.json``), micro-batch 4;
* ``ds-z2-offload``: ``from transformers import ...`` with ``deepspeed=`` the same config (DeepSpeed
  0.19.8, DeepSpeedCPUAdam), micro-batch 4;
* ``plait-z3``: plait.hf, ZeRO-3 without offload, micro-batch 4;
* ``plait-z3-compile`` / ``plait-z3-compile-fp8``: ``plait-z3`` with plait's ``compile`` section, and with
  float8 matmuls too (``"fp8": {"enabled": true, "recipe": "tensorwise"}``, through torchao; issue 46);
* ``fsdp2``: transformers' Trainer with ``fsdp="full_shard auto_wrap"``, FSDP2 (``fsdp_config: version 2``)
  wrapping each ``LlamaDecoderLayer``, micro-batch 4.

``--largest 3b,5b,7b``: instead, the largest Llama each framework's Trainer fine-tunes with ZeRO-3 +
offload_param + offload_optimizer (the Hugging Face test suite's ZeRO-3 config), micro-batch 1: sizes in
order, a framework stopping at its first failure; a size whose host footprint would pass 90% of
MemAvailable is skipped, not tried. Fine-tuning starts from a checkpoint: the parent writes one per size
(random bf16 weights, safetensors shards of at most 2 GB, written tensor by tensor) and each framework
loads it its own way under ZeRO-3: DeepSpeed through ``LlamaForCausalLM.from_pretrained`` after the
``TrainingArguments`` (``zero.Init``), plait through ``plait.hf.from_pretrained`` (meta construction, each
rank reading its shards).

``--largest 10b,13b --ratio 0.45 [--act-ckpt] [--micro 4]``: plait's GPU-first placement instead of full
offload (arms ``plait-z3-gpufirst-<size>``; ``ds-z3-gpufirst-<size>``: the same config read by DeepSpeed,
whose ZeRO-3 keeps the same share of its optimizer states on the GPU): ZeRO-3 with the weights on the GPU and
``offload_optimizer.ratio`` of the optimizer states on the host, the rest resident on the GPU
(``plait.zero.offload.placement``); ``--frameworks plait`` runs one framework only;
``--act-ckpt`` turns on the Trainer's ``gradient_checkpointing`` in every arm, ``--micro`` sets the micro-batch;
``--state-dtype int8`` (or bf16; with ``--frameworks plait``: DeepSpeed's config has no such key) stores Adam's
moments so (``optimizer.params.state_dtype``), and the host-memory guard counts them at that size.
``--log FILE`` appends every arm's full output to FILE.

``--nproc N`` with ``--largest``: the host-memory guard counts the states once (sharded over the ranks) and
each rank's process overhead N times (``_hf_sizes.host_need_gib``).

Reported per arm: the world size, tokens/s in total and per GPU over the timed steps (wall time between the ends of the warm-up and the last
step, each end after a CUDA synchronization), peak GPU memory of rank 0 (``torch.cuda.max_memory_allocated``), the
host peak summed over the ranks (each rank's VmHWM; ``host_peak_gib_ranks`` lists them), the last logged loss. Each arm prints one ``RESULT {json}`` line; the parent prints a markdown table (the
harness shared with bench_trl.py: ``_trainer.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offload import mem_available_gib  # noqa: E402
from _hf_sizes import host_need_gib, llama_shape, write_checkpoint  # noqa: E402
from _trainer import MICRO, ROOT, SEQ, SHAPE, SMOKE, launch_arm, print_table, step_clock  # noqa: E402
from _trainer import timed_train, trainer_arguments  # noqa: E402


def ds_config(arm: str, ratio: float = 1.0, state_dtype: str = "fp32") -> dict:
    """The arm's ds_config; ``state_dtype`` other than fp32 (plait arms of ``--largest`` only) is written as
    plait's ``optimizer.params.state_dtype``. ``plait-z3-compile`` adds plait's ``compile`` section, and
    ``plait-z3-compile-fp8`` the ``fp8`` section too (tensorwise: issue 46's Trainer path)."""
    if arm.endswith("-fp8"):
        return {
            **ds_config(arm.removesuffix("-fp8")),
            "fp8": {"enabled": True, "recipe": "tensorwise"},
        }
    if arm.endswith("-compile"):
        return {**ds_config(arm.removesuffix("-compile")), "compile": {"enabled": not SMOKE}}
    if "gpufirst" in arm:  # the weights on the GPU, a ratio of the optimizer states on the host
        config = ds_config("z3-offload", state_dtype=state_dtype)
        del config["zero_optimization"]["offload_param"]
        config["zero_optimization"]["offload_optimizer"]["ratio"] = ratio
        return config
    if "z3-offload" in arm:
        with open(
            os.path.join(
                ROOT, "tests", "data", "ds_configs", "transformers__ds_config_zero3_bf16.json"
            )
        ) as f:
            config = json.load(f)
        # transformers' DeepSpeed integration fills "auto" under "bf16" only, not the legacy "bfloat16" spelling
        config["bf16"] = config.pop("bfloat16")
        if state_dtype != "fp32":
            config["optimizer"]["params"]["state_dtype"] = state_dtype
        return config
    if arm.endswith("z2-offload"):
        with open(os.path.join(ROOT, "examples", "configs", "zero2_offload_hf.json")) as f:
            return json.load(f)
    return {
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }


def run_arm(
    arm: str,
    steps: int,
    warmup: int,
    checkpoint: str | None = None,
    ratio: float = 1.0,
    act_ckpt: bool = False,
    micro: int | None = None,
    state_dtype: str = "fp32",
    size: str | None = None,
) -> dict:
    import torch
    import transformers

    if arm.startswith("plait"):
        from plait.hf import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    shape = (
        llama_shape(size) if size else dict(SHAPE)
    )  # --size: the arms at that size, from its config
    sized = "z3-offload-" in arm or "gpufirst" in arm
    micro = micro or (
        1 if sized else MICRO
    )  # --largest: micro-batch 1 at a named size unless --micro
    if sized and arm.startswith("plait"):
        from plait.hf import from_pretrained

        model = from_pretrained(transformers.LlamaForCausalLM, checkpoint)
    elif not sized:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return (
                micro * (steps + warmup) * 4 * world
            )  # the Trainer's sampler gives each rank 1/world

        def __getitem__(self, i):
            ids = torch.randint(
                0, SHAPE["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(i)
            )
            return {"input_ids": ids, "labels": ids.clone()}

    world = int(os.environ.get("WORLD_SIZE", "1"))
    clock = step_clock(warmup, steps)
    extra = {}
    if arm.startswith(("plait", "ds")):
        extra["deepspeed"] = ds_config(arm, ratio, state_dtype)
    if arm == "fsdp2":
        extra.update(
            fsdp="full_shard auto_wrap",
            fsdp_config={
                "version": 2,
                "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                "reshard_after_forward": True,
            },
        )
    args = TrainingArguments(
        **trainer_arguments(arm, micro, steps + warmup), gradient_checkpointing=act_ckpt, **extra
    )
    if sized and arm.startswith("ds"):  # after TrainingArguments: loaded under zero.Init
        model = transformers.LlamaForCausalLM.from_pretrained(checkpoint)
    n_params = sum(
        getattr(p, "ds_numel", p.numel()) for p in model.parameters()
    )  # ds_numel: under zero.Init
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[clock])
    row = timed_train(arm, trainer, clock, micro * SEQ, n_params)
    # the moments' storage as the engine built it (plait's inner optimizer), not as asked
    built = getattr(getattr(trainer.optimizer, "optimizer", None), "state_dtype", "fp32")
    return {
        **row,
        "ratio": ratio if "gpufirst" in arm else 1.0,
        "micro": micro,
        "act_ckpt": act_ckpt,
        "state_dtype": built if arm.startswith("plait") else "fp32",
        **({"size": size} if size else {}),
    }


def main() -> None:
    cli = argparse.ArgumentParser()
    cli.add_argument("--arms", default="plait-z2-offload,ds-z2-offload,plait-z3,fsdp2")
    cli.add_argument("--steps", type=int, default=8)
    cli.add_argument("--warmup", type=int, default=3)
    cli.add_argument("--out", default=None)
    cli.add_argument("--log", default=None, help="append each arm's full output to this file")
    cli.add_argument(
        "--largest", default=None, help="sizes to try in order with ZeRO-3 + offload, e.g. 3b,5b,7b"
    )
    cli.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="--largest with plait's GPU-first placement: share of optimizer states on the host",
    )
    cli.add_argument("--frameworks", default="plait,ds", help="--largest: the frameworks, in order")
    cli.add_argument(
        "--act-ckpt", action="store_true", help="the Trainer's gradient_checkpointing in every arm"
    )
    cli.add_argument(
        "--micro", type=int, default=None, help="micro-batch (default: 4; --largest: 1)"
    )
    cli.add_argument(
        "--state-dtype",
        choices=("fp32", "bf16", "int8"),
        default="fp32",
        help="--largest: Adam's moments in plait's arms (optimizer.params.state_dtype; default fp32)",
    )
    cli.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="processes (GPUs) of each arm: torchrun --nproc-per-node",
    )
    cli.add_argument(
        "--size", default=None, help="the --arms at this size (e.g. 7.2b), not TinyLlama's 1.1B"
    )
    cli.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # the child process
    cli.add_argument("--checkpoint", default=None, help=argparse.SUPPRESS)
    opt = cli.parse_args()
    if opt.arm:
        result = run_arm(
            opt.arm,
            opt.steps,
            opt.warmup,
            opt.checkpoint,
            opt.ratio or 1.0,
            opt.act_ckpt,
            opt.micro,
            opt.state_dtype,
            opt.size,
        )
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    if opt.state_dtype != "fp32" and not (opt.largest and opt.frameworks == "plait"):
        cli.error(
            f"--state-dtype {opt.state_dtype} is plait's optimizer.params.state_dtype, which DeepSpeed's "
            "config has no key for: use it with --largest SIZES --frameworks plait"
        )
    rows = []
    arms = opt.arms.split(",")
    if opt.largest:
        kinds = (
            [f"{fw}-z3-gpufirst" for fw in opt.frameworks.split(",")]
            if opt.ratio is not None
            else [f"{fw}-z3-offload" for fw in opt.frameworks.split(",")]
        )
        arms = [f"{kind}-{size}" for kind in kinds for size in opt.largest.split(",")]
    failed = set()
    for arm in arms:
        fw = arm.split("-")[0]
        if opt.largest and fw in failed:
            continue
        if opt.largest:
            on_host = opt.ratio if "gpufirst" in arm else 1.0
            size = arm.rsplit("-", 1)[1]
            need = host_need_gib(fw, size, on_host, opt.state_dtype, opt.nproc)
            have = mem_available_gib()
            if need > 0.9 * have:
                row = {
                    "arm": arm,
                    "world": opt.nproc,
                    "error": f"skipped: needs ~{need:.0f} GiB host memory, {have:.0f} GiB available",
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
                failed.add(fw)
                continue
        args = [
            "--steps",
            str(opt.steps),
            "--warmup",
            str(opt.warmup),
            "--state-dtype",
            opt.state_dtype,
        ]
        args += (["--ratio", str(opt.ratio)] if opt.ratio is not None else []) + (
            ["--act-ckpt"] if opt.act_ckpt else []
        )
        args += ["--micro", str(opt.micro)] if opt.micro else []
        args += ["--size", opt.size] if opt.size else []
        if opt.largest:
            size = arm.rsplit("-", 1)[1]
            folder = os.path.join(tempfile.gettempdir(), f"bench_llama_{size}")
            if not os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
                write_checkpoint(folder, size)
            args += ["--checkpoint", folder]
        row = launch_arm(__file__, arm, args, opt.nproc, opt.log, opt.out)
        rows.append(row)
        if "error" in row:
            failed.add(fw)
    print_table(rows)


if __name__ == "__main__":
    main()
