"""`normlab compare runs/A runs/B ...`: the summary every norm ablation ends with (TensorBoard stays the live view).

Prints the settings in which the runs' resolved configs differ, then one row of final metrics per run, read from
its TensorBoard event files and newest checkpoint manifest:
- `val loss`: the last `val/loss`, ± the standard deviation of the last `--last` evaluations (how settled it is);
- `bpb`: the last bits per byte (`val/bpb`, else `eval/val/bpb` from `normlab evaluate`), `-` when never logged;
- `tokens`: tokens trained on (the manifest's `tokens_seen`, else steps × tokens per step from the config);
- `tok/s`: mean `throughput/tokens_per_sec` over the last `--last` points;
- `max attn logit`: the largest last `attn/max_logit/L*` over layers;
- `resid growth`: RMS of the stream entering the final norm (else the last block) over the RMS entering block 0.
Writes a plot of `train/loss` (and `val/loss`, dashed) against tokens for all runs (`--plot`, PNG).
"""
from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from training.checkpointing.layout import complete_checkpoints
from training.checkpointing.manifest import Manifest

log = logging.getLogger(__name__)

IGNORED_KEYS = ("name", "trainer.default_root_dir", "ckpt_path")  # differ between any two runs, by design


class CompareError(ValueError):
    pass


def _flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(config, dict):
        out: dict[str, Any] = {}
        for key, value in config.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: config}


def read_run(run_dir: Path) -> dict[str, Any]:
    """A run's flattened config, its scalars {tag: [(step, value)]} and its newest manifest (or None)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not (run_dir / "config.yaml").is_file() or not list(run_dir.glob("events.out.tfevents.*")):
        raise CompareError(f"'{run_dir}' is not a normlab run (no config.yaml and TensorBoard events); pass run "
                           "directories such as runs/NAME")
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    scalars = {tag: sorted({e.step: e.value for e in acc.Scalars(tag)}.items()) for tag in acc.Tags()["scalars"]}
    found = complete_checkpoints(run_dir)
    return {"dir": run_dir, "config": _flatten(yaml.safe_load((run_dir / "config.yaml").read_text()) or {}),
            "scalars": scalars, "manifest": Manifest.read(found[-1]) if found else None}


def tokens_per_step(run: dict[str, Any]) -> float:
    manifest, config = run["manifest"], run["config"]
    if manifest and manifest.tokens_seen and manifest.step:
        return manifest.tokens_seen / manifest.step
    devices = config.get("trainer.devices")
    world = (devices if isinstance(devices, int) else 1) * (config.get("trainer.num_nodes") or 1)
    return float(config.get("data.batch_size") or 0) * (config.get("data.seq_len") or 0) * world * (
        config.get("trainer.accumulate_grad_batches") or 1)


def _last(scalars: dict[str, list], tag: str) -> float | None:
    return scalars[tag][-1][1] if scalars.get(tag) else None


def summary(run: dict[str, Any], last: int) -> dict[str, Any]:
    s = run["scalars"]
    val = [v for _, v in s.get("val/loss", [])]
    bpb = _last(s, "val/bpb") if "val/bpb" in s else _last(s, "eval/val/bpb")
    steps = max((points[-1][0] for tag, points in s.items() if tag.startswith("train/")), default=0)
    manifest = run["manifest"]
    tokens = manifest.tokens_seen if manifest and manifest.step == steps else None
    layers = sorted((int(m.group(1)), tag) for tag in s if (m := re.fullmatch(r"resid/rms/L(\d+)", tag)))
    growth = None
    if layers:
        top = _last(s, "resid/final_in") or _last(s, layers[-1][1])
        growth = top / _last(s, layers[0][1]) if _last(s, layers[0][1]) else None
    logits = [_last(s, tag) for tag in s if re.fullmatch(r"attn/max_logit/L\d+", tag)]
    tps = [v for _, v in s.get("throughput/tokens_per_sec", [])[-last:]]
    return {
        "val_loss": val[-1] if val else None, "val_spread": float(np.std(val[-last:])) if val else None,
        "bpb": bpb, "steps": steps, "tokens": tokens if tokens is not None else steps * tokens_per_step(run),
        "tokens_per_sec": float(np.mean(tps)) if tps else None,
        "max_attn_logit": max(logits) if logits else None, "resid_growth": growth,
    }


def config_differences(runs: list[dict[str, Any]]) -> dict[str, list[Any]]:
    keys = sorted(set().union(*(r["config"] for r in runs)) - set(IGNORED_KEYS))
    return {k: [r["config"].get(k) for r in runs] for k in keys
            if len({repr(r["config"].get(k)) for r in runs}) > 1}


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=False)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip() for cells in lines)


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def report(runs: list[dict[str, Any]], summaries: list[dict[str, Any]], last: int) -> str:
    names = [r["dir"].name for r in runs]
    diffs = config_differences(runs)
    parts = ["config differences:" if diffs else "config differences: none (apart from the run names)"]
    if diffs:
        parts.append(_table(["setting", *names], [[k, *(str(v) for v in vals)] for k, vals in diffs.items()]))
    rows = [[name, f"{_fmt(m['val_loss'])} ± {_fmt(m['val_spread'])}", _fmt(m["bpb"]), str(m["steps"]),
             f"{m['tokens']:,.0f}", _fmt(m["tokens_per_sec"], ",.0f"), _fmt(m["max_attn_logit"], ".2f"),
             _fmt(m["resid_growth"], ".2f")] for name, m in zip(names, summaries, strict=False)]
    parts += ["", f"final metrics (± = std over the last {last} evaluations):",
              _table(["run", "val loss", "bpb", "steps", "tokens", "tok/s", "max attn logit", "resid growth"], rows)]
    return "\n".join(parts) + "\n"


def plot(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in runs:
        per_step = tokens_per_step(run)
        for tag, style in (("train/loss", "-"), ("val/loss", "--")):
            points = run["scalars"].get(tag, [])
            if points:
                steps, values = zip(*points, strict=False)
                ax.plot(np.array(steps) * per_step, values, style, label=f"{run['dir'].name} {tag.split('/')[0]}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(out)  # atomically


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="normlab compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (runs/NAME)")
    ap.add_argument("--last", type=int, default=3, help="evaluations / throughput points the spread and mean use")
    ap.add_argument("--plot", type=Path, default=Path("compare.png"), help="where the loss-vs-tokens plot goes")
    args = ap.parse_args(argv)
    try:
        if args.last < 1:
            raise CompareError(f"--last {args.last}: must be at least 1")
        runs = [read_run(path) for path in args.runs]
    except CompareError as err:
        print(f"normlab compare: error: {err}", file=sys.stderr)
        return 2
    sys.stdout.write(report(runs, [summary(r, args.last) for r in runs], args.last))
    plot(runs, args.plot)
    print(f"\nloss against tokens: {args.plot}")
    return 0
