"""``plait.trl``: TRL's SFT and DPO scripts (``tests/data/trl_script.py``, written as TRL's docs show, only the import
line naming plait, the Trainer's defaults: clipping at max_grad_norm=1.0) against the same script with ``from trl
import`` and no DeepSpeed, on CPU, with axolotl's ZeRO-2 (optimizer offload) and LLaMA-Factory's ZeRO-3 (optimizer
and parameter offload) configs, SFT and DPO each at 1 and 2 processes.

Tolerance 1e-6 on each of 10 logged step losses: the runs take the same batches, AdamW, schedule and clipping and
differ in summation order and in the clip coefficient's last digits; 1e-6 is one float32 spacing at SFT's loss
(9.5e-7 at 9.7), 16 at DPO's (0.69). Measured: <= 9.5e-7 (SFT), <= 3e-7 (DPO). Both configs say
``"gradient_clipping": "auto"``, which the Trainer's max_grad_norm fills, so plait clips as plain TRL does (a config
without the key, as FastChat's, clips under neither DeepSpeed, whose default is 0, nor plait: against plain TRL at
max_grad_norm=1.0 that is 7e-6 at step 2 and 1e-3 by step 7 here, through Adam's eps).
Why the coefficients' last digits do not matter: plait's coefficient comes from the float64 norm (2.9777828 at SFT's
step 1, exact; DeepSpeed also sums float64 per-parameter norms), plain TRL's from torch's float32 ``clip_grad_norm_``
(2.977663: torch's CPU ``vector_norm`` sums a tensor's squares in float32 lanes, 1.7e-4 low on the 1.05M-element
head; the logged norms differ by 2e-5..1.7e-4). Adam divides a factor common to all steps out but for eps: a
relative change d of the coefficient c moves element i's update by at most d * lr * eps|cg_i| / (|cg_i| + eps)^2,
and the next loss by at most the sum of |g_i| times that: 1.3e-9 at SFT's step 1 (d = 4e-5, lr = 1e-3). The steps'
d differ by up to 6e-5 (SFT), which Adam's moments mix: to first order that moves each update by at most 2 * lr *
6e-5 / 2 and the loss by at most ||g||_1 (354) times that, 2e-5, a bound that needs every element's change aligned
with its gradient. Measured: 0 or 1 float32 spacing; plain TRL run with its norm taken in float64 gives its own
losses bit for bit, so 1e-6 holds with clipping on. A deliberately broken plait fails it: clipping skipped, 9.6e-4 (SFT,
1 process); the norm of half the gradient, 6.7e-4 (and its logged norm 34% low, beyond ``NORM_RTOL``).
The resume (dropout on) is exact: bitwise, as in tests/test_hf_resume_dropout.py; its uninterrupted run is also the
2-process SFT case. At the lowest pins (transformers 4.56, trl 0.18.2) transformers rounds the logged loss to 4
decimals on both sides: the tolerance there is one rounding step (1e-4) above the 1e-6.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

DATA = Path(__file__).parent / "data"
SCRIPT = DATA / "trl_script.py"
ZERO2 = DATA / "ds_configs" / "axolotl__zero2.json"
ZERO3 = DATA / "ds_configs" / "llama-factory__ds_z3_offload_config.json"
# transformers < 5 logs round(loss, 4): two equal losses 1e-6 apart can round one step (1e-4) apart
LOSS_TOL = 1e-6 if Version(transformers.__version__) >= Version("5") else 1e-4 + 1e-6
# torch's CPU float32 vector_norm (plain TRL's clip_grad_norm_) sums a tensor's n squares in >= 8 float32 lanes:
# recursive summation's bound (n/8) * 2^-24 on the sum of squares, half that on the norm, for the largest
# tensor (the 16384 x 64 head); plait's float64 norm is exact to 1e-15
NORM_RTOL = 16384 * 64 / 8 * 2.0**-24 / 2


def launch(out: Path, script: Path, task: str, config, steps: int, *extra, procs: int = 1):
    """Run the script under torchrun; returns ({step: {"loss", "grad_norm", "learning_rate"}}, [result per rank],
    out)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(procs),
        str(script),
        task,
        str(out),
        str(config),
        str(steps),
        *extra,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = {r["step"]: r for r in map(json.loads, (out / "losses.jsonl").read_text().splitlines())}
    results = [json.loads((out / f"result-{r}.json").read_text()) for r in range(procs)]
    return logs, results, out


DROPOUT = ("--dropout", "0.1")
# case: (task, config, processes, script flags); SFT at 2 processes is the resume test's uninterrupted run
CASES = {
    "sft-1proc-zero2": ("sft", ZERO2, 1, ()),
    "dpo-1proc-zero2": ("dpo", ZERO2, 1, ()),
    "sft-2proc-zero3": ("sft", ZERO3, 2, DROPOUT),
    "dpo-2proc-zero3": ("dpo", ZERO3, 2, ()),
}


@pytest.fixture(scope="module")
def plait_runs(tmp_path_factory):
    """One launch per case on plait, the Trainer's default clipping."""
    tmp = tmp_path_factory.mktemp("trl_plait")
    return {
        case: launch(tmp / case, SCRIPT, task, config, 10, *flags, procs=procs)
        for case, (task, config, procs, flags) in CASES.items()
    }


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    """The same script with ``from trl import`` and no ds_config, one launch per case."""
    tmp = tmp_path_factory.mktemp("trl_plain")
    plain = tmp / "plain_script.py"
    text = SCRIPT.read_text()
    assert "from plait.trl import" in text
    plain.write_text(text.replace("from plait.trl import", "from trl import"))
    return {
        case: launch(tmp / case, plain, task, "none", 10, *flags, procs=procs)
        for case, (task, _, procs, flags) in CASES.items()
    }


@pytest.fixture(scope="module")
def resume_runs(plait_runs, tmp_path_factory):
    """The 2-process ZeRO-3 SFT case (dropout on) resumed from its step-5 checkpoint."""
    tmp = tmp_path_factory.mktemp("trl_resume")
    task, config, procs, flags = CASES["sft-2proc-zero3"]
    whole = plait_runs["sft-2proc-zero3"]
    return whole, launch(
        tmp / "resumed",
        SCRIPT,
        task,
        config,
        10,
        *flags,
        "--resume",
        str(whole[2] / "checkpoint-5"),
        procs=procs,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_the_script_on_plait_gives_plain_trls_losses(case, plait_runs, plain_runs):
    ours, theirs = plait_runs[case][0], plain_runs[case][0]
    assert sorted(ours) == sorted(theirs) == list(range(1, 11))
    worst = max(abs(ours[s]["loss"] - theirs[s]["loss"]) for s in range(1, 11))
    assert worst <= LOSS_TOL, (
        {s: ours[s]["loss"] for s in ours},
        {s: theirs[s]["loss"] for s in theirs},
    )
    norms = [(ours[s]["grad_norm"], theirs[s]["grad_norm"]) for s in range(1, 11)]
    assert all(abs(a / b - 1) <= NORM_RTOL for a, b in norms), norms
    assert (
        plain_runs[case][1][0]["ref_params_bytes"] is None
    )  # plain TRL: a whole reference copy, no engine


def test_the_default_clipping_is_on_in_these_runs(plait_runs):
    """The gradient norms the cases log are above max_grad_norm=1.0 at some steps of each task, so the parity
    above covers steps that clip (SFT: ~3 at every step; DPO: just above 1 at some)."""
    for task in ("sft", "dpo"):
        norms = [
            r["grad_norm"]
            for case, (t, *_) in CASES.items()
            if t == task
            for r in plait_runs[case][0].values()
        ]
        assert sum(n > 1.0 for n in norms) >= 3, norms


@pytest.mark.parametrize("case", list(CASES))
def test_the_script_trains_on_plait(case, plait_runs):
    """The loss moves over the run by far more than the parity tolerance (DPO at 1 process, 4 pairs a step, moves
    least: 5.7e-3)."""
    losses = {s: r["loss"] for s, r in plait_runs[case][0].items()}
    assert sorted(losses) == list(range(1, 11)) and abs(losses[10] - losses[1]) > 1e-3, losses


def test_dpo_reference_model_is_sharded_under_zero3(plait_runs):
    """The reference model's forward-only engine (TRL's prepare_deepspeed): under ZeRO-3 each of the 2 ranks holds
    about half (the config's "auto" persistence threshold, 10 x hidden = 640 elements, keeps only the norms'
    weights whole)."""
    for rank in plait_runs["dpo-2proc-zero3"][1]:
        assert 0.45 * rank["whole_bytes"] < rank["ref_params_bytes"] < 0.55 * rank["whole_bytes"]


def test_a_resumed_sft_run_with_dropout_repeats_the_uninterrupted_steps(resume_runs):
    (full, _, _), (resumed, _, _) = resume_runs
    assert sorted(resumed) == list(range(6, 11))  # the steps after the checkpoint
    assert {s: resumed[s]["loss"] for s in range(6, 11)} == {
        s: full[s]["loss"] for s in range(6, 11)
    }
    assert len({r["loss"] for r in full.values()}) == 10


def test_dpo_reference_under_zero2_is_a_forward_only_stage_0_engine(tmp_path):
    """ZeRO stages 0-2: the reference model is whole on each rank (stage 0) and has no optimizer, as TRL's
    prepare_deepspeed makes it; the config's optimizer offload is not carried over."""
    from datasets import Dataset

    from plait.engine import Engine
    from plait.trl import DPOConfig, DPOTrainer

    model, tokenizer = _tiny()
    ref, _ = _tiny()
    args = DPOConfig(
        output_dir=str(tmp_path),
        deepspeed=str(ZERO2),
        use_cpu=True,
        report_to=[],
        max_steps=1,
        per_device_train_batch_size=2,
        bf16=False,
        save_strategy="no",
    )
    data = Dataset.from_dict({"prompt": ["a"] * 4, "chosen": ["a a"] * 4, "rejected": ["a"] * 4})
    trainer = DPOTrainer(
        model=model, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer
    )
    trainer.train()
    assert isinstance(trainer.ref_model, Engine) and trainer.ref_model.forward_only
    assert (
        trainer.ref_model.zero_optimization_stage() == 0
        and trainer.engine.zero_optimization_stage() == 2
    )
    assert not trainer.ref_model.module.training


def _tiny():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    core = Tokenizer(
        models.WordLevel({"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3}, unk_token="<unk>")
    )
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side="left",
    )
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
        )
    )
    return model, tokenizer


def test_a_feature_plait_does_not_serve_is_refused_by_name(tmp_path):
    from datasets import Dataset

    from plait.config import ConfigError
    from plait.trl import SFTConfig, SFTTrainer

    model, tokenizer = _tiny()
    args = SFTConfig(
        output_dir=str(tmp_path),
        deepspeed={"zero_optimization": {"stage": 2}},
        use_cpu=True,
        report_to=[],
        activation_offloading=True,
    )
    with pytest.raises(
        ConfigError,
        match=r"activation_offloading=True: .*set activation_offloading=False in the SFTConfig",
    ):
        SFTTrainer(
            model=model,
            args=args,
            train_dataset=Dataset.from_dict({"text": ["a a a"] * 4}),
            processing_class=tokenizer,
        )


def test_grpo_is_refused_naming_what_plait_does_not_serve(tmp_path):
    from datasets import Dataset

    from plait.config import ConfigError
    from plait.trl import GRPOConfig, GRPOTrainer

    model, tokenizer = _tiny()
    args = GRPOConfig(
        output_dir=str(tmp_path),
        deepspeed={"zero_optimization": {"stage": 3}},
        use_cpu=True,
        report_to=[],
        per_device_train_batch_size=2,
        num_generations=2,
    )
    with pytest.raises(
        ConfigError, match=r"GRPOTrainer: .*own sampler .*unwrap_model.*trl.GRPOTrainer"
    ):
        GRPOTrainer(
            model=model,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=Dataset.from_dict({"prompt": ["a a"] * 4}),
            processing_class=tokenizer,
        )


def test_reward_trainer_on_plait_gives_plain_trls_losses(tmp_path):
    """TRL's RewardTrainer (a sequence-classification model, chosen/rejected pairs) on plait's ZeRO-2 and plain, in
    this process: the same logged losses, to 1e-6 (transformers >= 5) or to the 4 decimals transformers 4.x rounds
    the plain run's logged loss to (5e-5 and float32 rounding)."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForSequenceClassification
    from trl import RewardConfig as PlainConfig, RewardTrainer as PlainTrainer

    from plait.trl import RewardConfig, RewardTrainer

    _, tokenizer = _tiny()
    data = Dataset.from_dict({"chosen": ["a a a", "a a"] * 4, "rejected": ["a", "<unk> a"] * 4})

    def losses(trainer_class, config_class, **ds):
        torch.manual_seed(0)
        model = LlamaForSequenceClassification(
            LlamaConfig(
                vocab_size=32,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                num_labels=1,
                pad_token_id=0,
            )
        )
        args = config_class(
            output_dir=str(tmp_path),
            use_cpu=True,
            report_to=[],
            max_steps=6,
            seed=3,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            bf16=False,
            logging_steps=1,
            save_strategy="no",
            max_grad_norm=0.0,
            **ds,
        )
        trainer = trainer_class(
            model=model, args=args, train_dataset=data, processing_class=tokenizer
        )
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    got = losses(RewardTrainer, RewardConfig, deepspeed={"zero_optimization": {"stage": 2}})
    want = losses(PlainTrainer, PlainConfig)
    tol = 1e-6 if Version(transformers.__version__) >= Version("5") else 5e-5 + 1e-6
    assert len(got) == len(want) == 6 and max(abs(a - b) for a, b in zip(got, want)) <= tol, (
        got,
        want,
    )
    assert got[0] - got[-1] > 0.1  # the pairs get separated
