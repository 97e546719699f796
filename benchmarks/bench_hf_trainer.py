"""The Hugging Face Trainer on one GPU: plait (``plait.hf``) against DeepSpeed and FSDP2 under the same
Trainer script, in the same run.

    python benchmarks/bench_hf_trainer.py [--arms plait-z2-offload,ds-z2-offload,plait-z3,fsdp2]
        [--steps 8] [--warmup 3] [--out results.jsonl]

Model: an unmodified ``transformers.LlamaForCausalLM`` of TinyLlama's shape (hidden 2048, 22 layers, 32 heads,
4 kv heads, ffn 5632, vocab 32000: 1.1B parameters), built from its config, sequence 2048, bf16,
AdamW (lr 1e-4, weight decay 0.1), clip 1.0; random tokens. Arms (each in its own process, launched with
torchrun, one process):

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

Reported per arm: tokens/s over the timed steps (wall time between the ends of the warm-up and the last
step, each end after a CUDA synchronization), peak GPU memory (``torch.cuda.max_memory_allocated``), the
last logged loss. Each arm prints one ``RESULT {json}`` line; the parent prints a markdown table (the
harness shared with bench_trl.py: ``_trainer.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offload import HOST_BYTES_PER_PARAM, mem_available_gib  # noqa: E402
from _offload_arm import SIZES  # noqa: E402
from _trainer import MICRO, ROOT, SEQ, SHAPE, SMOKE, launch_arm, print_table, step_clock  # noqa: E402
from _trainer import timed_train, trainer_arguments  # noqa: E402


# --largest: bench_offload's Llama sizes and host bytes per parameter under ZeRO-3 + full offload
HOST_BYTES = HOST_BYTES_PER_PARAM
if SMOKE:
    SIZES = {k: (32, 2, 4, 2, 64) for k in SIZES}


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


def llama_shape(size: str) -> dict:
    """The LlamaConfig fields of bench_offload's size ``size``."""
    h, n, heads, kv, ffn = SIZES[size]
    shape = dict(SHAPE)
    shape.update(
        hidden_size=h,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=ffn,
    )
    return shape


def write_checkpoint(folder: str, size: str) -> None:
    """A Hugging Face Llama checkpoint of ``size`` with random bf16 weights (std 0.02, norms 1), written
    tensor by tensor into safetensors shards of at most 2 GB with their index: the host never holds more
    than one shard."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from plait.zero import meta_parameters

    config = transformers.LlamaConfig(**llama_shape(size), torch_dtype="bfloat16")
    with meta_parameters():
        names = [(n, p.shape) for n, p in transformers.LlamaForCausalLM(config).named_parameters()]
    os.makedirs(folder, exist_ok=True)
    config.save_pretrained(folder)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(0)
    shard, shard_bytes, weight_map, files = {}, 0, {}, []

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(shard, name))

    for n, shape in names:
        t = (
            torch.ones(shape)
            if "norm" in n
            else torch.randn(shape, generator=gen, device=dev).mul_(0.02)
        )
        if shard and shard_bytes + t.numel() * 2 > 2 * 2**30:
            flush()
            shard, shard_bytes = {}, 0
        shard[n] = t.to(torch.bfloat16).cpu()
        shard_bytes += t.numel() * 2
    flush()
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    if dev == "cuda":  # the arm's process gets the GPU: this one keeps only its CUDA context
        torch.cuda.empty_cache()


def run_arm(
    arm: str,
    steps: int,
    warmup: int,
    checkpoint: str | None = None,
    ratio: float = 1.0,
    act_ckpt: bool = False,
    micro: int | None = None,
    state_dtype: str = "fp32",
) -> dict:
    import torch
    import transformers

    if arm.startswith("plait"):
        from plait.hf import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    shape, sized = dict(SHAPE), "z3-offload-" in arm or "gpufirst" in arm
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
            return micro * (steps + warmup) * 4

        def __getitem__(self, i):
            ids = torch.randint(
                0, SHAPE["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(i)
            )
            return {"input_ids": ids, "labels": ids.clone()}

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
    }


def host_bytes_per_param(fw: str, state_dtype: str) -> float:
    """Host bytes per host-side parameter under ZeRO-3 + offload: bench_offload's fp32-moment figure with the
    two moments (8 bytes) stored in ``state_dtype`` instead (``plait.fit.plan.moment_bytes``)."""
    from plait.fit.plan import moment_bytes

    return HOST_BYTES[fw] - 8 + moment_bytes(2**20, state_dtype) / 2**20


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
        )
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
            h, n, heads, kv, ffn = SIZES[arm.rsplit("-", 1)[1]]
            params = n * (2 * h * h * (1 + kv / heads) + 3 * h * ffn) + 2 * 32000 * h
            on_host = opt.ratio if "gpufirst" in arm else 1.0
            need = params * host_bytes_per_param(fw, opt.state_dtype) * on_host / 2**30
            have = mem_available_gib()
            if need > 0.9 * have:
                row = {
                    "arm": arm,
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
        if opt.largest:
            size = arm.rsplit("-", 1)[1]
            folder = os.path.join(tempfile.gettempdir(), f"bench_llama_{size}")
            if not os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
                write_checkpoint(folder, size)
            args += ["--checkpoint", folder]
        row = launch_arm(__file__, arm, args, opt.log, opt.out)
        rows.append(row)
        if "error" in row:
            failed.add(fw)
    print_table(rows)


if __name__ == "__main__":
    main()
