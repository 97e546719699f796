"""Plot the loss curves of a training run from its metrics JSONL.

    python examples/plot_metrics.py runs/pretrain_gpt/metrics.jsonl loss.png [more.jsonl ...]

Draws the training loss (one point per progress line) and the validation loss against the
optimizer step. A resumed run appends to the same file; for a step logged twice the later record
wins. Several files draw several runs on one plot (labelled by their directory).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_curves(path: Path) -> dict[str, dict[int, float]]:
    """``{"train": {step: loss}, "val": {step: val_loss}}`` from one JSONL file."""
    curves = {"train": {}, "val": {}}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            if rec.get("type") == "train" and "loss" in rec:
                curves["train"][int(rec["step"])] = float(rec["loss"])
            elif rec.get("type") == "val":
                curves["val"][int(rec["step"])] = float(rec["val_loss"])
    return curves


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("metrics", type=Path, help="metrics.jsonl written by a training script")
    parser.add_argument("out", type=Path, help="PNG to write")
    parser.add_argument(
        "more", type=Path, nargs="*", help="more metrics files to draw on the same axes"
    )
    parser.add_argument("--title", default="plait: loss")
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    files = [args.metrics, *args.more]
    for path in files:
        curves = read_curves(path)
        label = "" if len(files) == 1 else f"{path.parent.name}: "
        for kind, style in (("train", "-"), ("val", "o-")):
            points = sorted(curves[kind].items())
            if points:
                ax.plot(
                    [s for s, _ in points],
                    [v for _, v in points],
                    style,
                    markersize=3,
                    label=f"{label}{'training' if kind == 'train' else 'validation'} loss",
                )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(args.title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
