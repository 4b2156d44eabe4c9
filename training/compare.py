"""`normlab compare runs/A runs/B ...`: the summary every norm ablation ends with (TensorBoard stays the live view).

Prints the settings in which the runs' resolved configs differ — the model's fields as the model was built (its
newest checkpoint's `model_config.json`, else resolved from its preset: `pre`, not None) — then one row of final
metrics per run, read from its TensorBoard event files and newest checkpoint manifest:
- the metric (`--metric`, any scalar tag; by default `val/loss`, else `train/loss` when some run never validated,
  which the first line of the output says): its last value. One run has no spread over seeds; `--group_by`
  groups runs into cells with the seed as the replicate, and gives mean ± sd over seeds;
- `bpb`: the last bits per byte (`val/bpb`, else `eval/val/bpb` from `normlab evaluate`), `-` when never logged;
- `tokens`: tokens trained on (the manifest's `tokens_seen`, else steps × tokens per step from the config);
- `tok/s*`, `MFU*`: mean `throughput/tokens_per_sec` and `throughput/mfu` over the last `--last` points — marked:
  they measure the machine and its load at the time, not the config;
- `logit peak`: the largest exact attention logit over training, every layer and head (`max_logit_peak`, from
  `attn/max_logit_exact_worst/L*`; `-` for a run that did not log it);
- `resid growth`: RMS of the stream entering the final norm (else the last block) over the RMS entering block 0.
`--plot FILE` writes a plot of `train/loss` (solid) and the metric (dashed) against tokens, one colour per run;
there is no default file, and an existing one is not overwritten.

`--group_by KEY...` (config keys, e.g. `model.placement optim.lr`) instead groups the runs into cells by those
keys, takes `seed_everything` as the replicate, and prints the sweep report's tables (training/sweep/report.py,
the same code): per cell the seeds, outcomes and the final metric's mean ± sd and 95% interval; with
`--baseline CELL` the paired differences, Holm-corrected verdicts against `--margin`; with an LR key among the
groups (`--lr_key`, default `optim.lr`), each group's best LR and LR sensitivity; `--reduce` and `--outcome` judge
a reduction of the metric and the stability outcomes as a sweep spec's `metric` and `outcomes` do
(training/sweep/outcomes.py). How to read them: docs/sweep-report.md.
"""
from __future__ import annotations

import argparse
import difflib
import logging
import sys
from pathlib import Path
from typing import Any

import numpy as np

from training import health_tags, safe_yaml
from training.errors import UserError
from training.eval import metrics
from training.plotting import pyplot, save_figure
from training.run.dir import RunDir
from training.stats import MODES, Reduction, series_peak
from training.sweep.alive import alive
from training.sweep.outcomes import parse_outcomes
from training.sweep.results import TRAIN_LOSS, RunResult, plain_tags, result

log = logging.getLogger(__name__)

IGNORED_KEYS = ("name", "trainer.default_root_dir", "ckpt_path")  # differ between any two runs, by design
SEED_KEY = "seed_everything"  # the replicate key of `--group_by`
DATA_SEED_KEY = "data.seed"  # a sweep's default data order follows the seed: a replicate key too
MACHINE = "* measured on the machine, with its load, at the time: not a property of the config"
DEFAULT_METRICS = ("val/loss", "train/loss")  # without --metric: the first of these that every run logs


def summary(run: RunDir, last: int, metric: str = "val/loss") -> dict[str, Any]:
    s = run.scalars
    bpb = run.last(metrics.tag("val", "bits_per_byte"))  # the loop's, else `normlab evaluate`'s of the same set
    bpb = bpb if bpb is not None else run.last(metrics.tag("eval/val", "bits_per_byte"))
    steps = max((points[-1][0] for tag, points in s.items() if tag.startswith("train/")), default=0)
    manifest = run.manifest
    tokens = manifest.tokens_seen if manifest and manifest.step == steps else None
    layers = health_tags.by_layer(s, health_tags.RESID_RMS)
    growth = None
    if layers:
        top = run.last(health_tags.FINAL_IN) or run.last(layers[-1][1])
        growth = top / run.last(layers[0][1]) if run.last(layers[0][1]) else None
    exact = health_tags.by_layer(s, health_tags.ATTN_MAX_LOGIT_EXACT + health_tags.WORST)
    peak = series_peak(s[tag] for _, tag in exact)
    tps, mfu = ([v for _, v in s.get(tag, [])[-last:]] for tag in ("throughput/tokens_per_sec", "throughput/mfu"))
    return {
        "metric": run.last(metric), "bpb": bpb, "steps": steps,
        "tokens": tokens if tokens is not None else steps * run.tokens_per_step(),
        "tokens_per_sec": float(np.mean(tps)) if tps else None, "mfu": float(np.mean(mfu)) if mfu else None,
        "max_logit_peak": None if np.isnan(peak) else peak, "resid_growth": growth,
    }


def config_differences(runs: list[RunDir]) -> dict[str, list[Any]]:
    """The settings whose resolved values differ between the runs (`RunDir.resolved_config`: model fields as built)."""
    flats = [r.resolved_config for r in runs]
    keys = sorted(set().union(*flats) - set(IGNORED_KEYS))
    return {k: [f.get(k) for f in flats] for k in keys if len({repr(f.get(k)) for f in flats}) > 1}


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(x) for x in col) for col in zip(header, *rows, strict=False)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)).rstrip() for cells in lines)


def _fmt(value: Any, spec: str = ".4f") -> str:
    return "-" if value is None else format(value, spec)


def summary_table(runs: list[RunDir], summaries: list[dict[str, Any]], last: int, metric: str = "val/loss") -> str:
    names = [r.name for r in runs]
    diffs = config_differences(runs)
    parts = ["config differences:" if diffs else "config differences: none (apart from the run names)"]
    if diffs:
        parts.append(_table(["setting", *names], [[k, *(str(v) for v in vals)] for k, vals in diffs.items()]))
    rows = [[name, _fmt(m["metric"]), _fmt(m["bpb"]), str(m["steps"]), f"{m['tokens']:,.0f}",
             _fmt(m["tokens_per_sec"], ",.0f"), _fmt(m["mfu"], ".1%"), _fmt(m["max_logit_peak"], ".2f"),
             _fmt(m["resid_growth"], ".2f")] for name, m in zip(names, summaries, strict=False)]
    parts += ["", f"final metrics (one run each: no spread over seeds — --group_by KEY groups runs into cells, with "
                  f"mean ± sd over seeds; tok/s and MFU: the mean of the last {last} points):",
              _table(["run", metric, "bpb", "steps", "tokens", "tok/s*", "MFU*", "logit peak", "resid growth"], rows),
              MACHINE]
    return "\n".join(parts) + "\n"


def plot(runs: list[RunDir], out: Path, metric: str = "val/loss") -> None:
    """`train/loss` (solid) and `metric` (dashed, with markers: a run may validate once) against tokens, one colour
    per run."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        per_step = run.tokens_per_step()
        for tag, style in (("train/loss", "-"), *([(metric, "--o")] if metric != "train/loss" else [])):
            points = run.scalars.get(tag, [])
            if points:
                steps, values = zip(*points, strict=False)
                ax.plot(np.array(steps) * per_step, values, style, color=colours[i % len(colours)], markersize=3,
                        label=f"{run.name} {tag}")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss" if metric.endswith("loss") else f"loss, {metric}")
    ax.set_title(f"solid: train/loss; dashed: {metric}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, out, dpi=120)


def group(runs: list[RunDir], keys: list[str], metric: str, reduce: Reduction | None = None,
          outcomes: dict[str, dict[str, Any]] | None = None) -> list[RunResult]:
    """Each run as a result of the cell named by its values of `keys`, its seed the replicate (`reduce`,
    `outcomes`: as a sweep spec's)."""
    out, seen = [], {}
    for run in runs:
        for key in keys:
            if key not in run.flat_config:
                near = difflib.get_close_matches(key, list(run.flat_config), n=3)
                raise UserError(f"--group_by {key}: no such key in '{run.config_file}'"
                                + (f"; did you mean {' or '.join(near)}?" if near else ""))
        params = {k: run.flat_config[k] for k in keys}
        cell = ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in params.items())
        seed = run.flat_config.get(SEED_KEY)
        if (cell, seed) in seen:
            raise UserError(f"runs '{seen[cell, seed]}' and '{run.path}' are both {cell} at {SEED_KEY}={seed}: "
                            "a cell needs one run per seed; group by the key that tells them apart")
        seen[cell, seed] = run.path
        status = run.status(alive, nonfinite=(TRAIN_LOSS, metric))  # the sweep's status, and a non-finite log
        out.append(result(cell, params, seed, run.path, status, metric, run, reduce, outcomes))
    return out


def grouped(runs: list[RunDir], args: argparse.Namespace) -> str:
    """The sweep report's tables for the runs grouped by `--group_by`."""
    from training.sweep.report import check, tables

    results = group(runs, args.group_by, args.metric, args.reduce, args.outcomes)
    lr_key = args.lr_key if args.lr_key in args.group_by else None
    sweep = {"metric": args.metric, "reduce": args.reduce.to_json(), "mode": args.mode, "baseline": args.baseline,
             "margin": args.margin, "lr_key": lr_key, "axes": args.group_by, "outcomes": args.outcomes}
    if "lr_reach" in args.outcomes and lr_key is None:
        raise UserError(f"--outcome lr_reach compares LR groups: --group_by the learning-rate key ({args.lr_key}) too")
    check(results, sweep)
    replicate = (*args.group_by, SEED_KEY, *([DATA_SEED_KEY] if _follows_seed(runs) else []))
    loose = [k for k in config_differences(runs) if k not in replicate]
    lines = tables(sweep, results)
    if loose:
        lines += [f"Note: the runs also differ in {', '.join(loose)} (not grouped by): a cell's seeds may differ "
                  "in more than the seed."]
    return "\n".join(lines) + "\n"


def _follows_seed(runs: list[RunDir]) -> bool:
    """Whether every run's data order is its seed (a sweep's default `data_order: seed`): then `data.seed` differs
    between seeds by design."""
    return all(r.flat_config.get(DATA_SEED_KEY) == r.flat_config.get(SEED_KEY) for r in runs)


def outcome_flags(values: list[list[str]] | None) -> dict[str, dict[str, Any]]:
    """`--outcome NAME KEY=VALUE ...` (repeated) as a spec's `outcomes` mapping, validated the same way."""
    raw: dict[str, dict[str, Any]] = {}
    for name, *settings in values or []:
        pairs = [item.split("=", 1) for item in settings]
        if any(len(p) != 2 for p in pairs):
            raise UserError(f"--outcome {name}: give its settings as KEY=VALUE, e.g. --outcome spikes window=50 "
                            "threshold=6 margin=1")
        raw[name] = {k: safe_yaml.load(v, f"--outcome {name} {k}") for k, v in pairs}
    try:
        return parse_outcomes(raw)
    except ValueError as err:
        raise UserError(f"--outcome: {err}") from None


def choose_metric(runs: list[RunDir], metric: str | None) -> tuple[str, str | None]:
    """(the metric compared, a line saying so when it is not the default). An explicit `metric` must be logged by
    some run; without one, the first of DEFAULT_METRICS that every run logs (diverged runs aside: a divergence is
    an outcome, not a number, and may come before the first validation)."""
    if metric is not None:
        if any(metric in r.scalars for r in runs):
            return metric, None
        problem = f"--metric {metric!r} is logged by none of the runs"
    else:
        judged = [r for r in runs if r.status(alive, nonfinite=(TRAIN_LOSS,)) != "diverged"] or runs
        common = [tag for tag in DEFAULT_METRICS if all(tag in r.scalars for r in judged)]
        if common and common[0] == DEFAULT_METRICS[0]:
            return common[0], None
        if common:
            missing = ", ".join(str(r.path) for r in judged if DEFAULT_METRICS[0] not in r.scalars)
            return common[0], f"metric: {common[0]} ({DEFAULT_METRICS[0]} is not logged by {missing}; --metric " \
                              "chooses another)"
        problem = f"none of {', '.join(DEFAULT_METRICS)} is logged by every run"
    tags = sorted(plain_tags(t for r in runs for t in r.scalars), key=lambda t: not t.endswith("/loss"))
    raise UserError(f"{problem}; choose a scalar tag they log with --metric, e.g. {', '.join(tags[:12])}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="normlab compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (runs/NAME)")
    ap.add_argument("--metric", help="the scalar tag compared (any TensorBoard tag, e.g. eval/...; default: val/loss, "
                    "else train/loss when some run does not log val/loss)")
    ap.add_argument("--last", type=int, default=3, help="throughput points the tok/s and MFU means use")
    ap.add_argument("--plot", type=Path, default=None,
                    help="write the loss-vs-tokens plot to this PNG (none by default; an existing file is refused)")
    ap.add_argument("--group_by", nargs="+", metavar="KEY", help="config keys that make a cell (seeds replicate)")
    ap.add_argument("--mode", choices=MODES, default="min", help="with --group_by: which way is better")
    ap.add_argument("--baseline", help="with --group_by: the cell the others are compared with (as printed)")
    ap.add_argument("--margin", type=float, help="with --baseline: the equivalence margin (in the metric's units)")
    ap.add_argument("--lr_key", default="optim.lr", help="with --group_by: the learning-rate key, if grouped by")
    ap.add_argument("--reduce", default="final", help="with --group_by: final | min | max | mean_last:K — one number "
                    "of the metric per run, as a sweep spec's metric.reduce")
    ap.add_argument("--outcome", nargs="+", action="append", metavar=("NAME", "KEY=VALUE"),
                    help="with --group_by: judge a stability outcome too, as a spec's `outcomes` (repeatable): "
                    "spikes window=W threshold=Z [margin=M] | max_logit_peak [margin=M] | lr_reach delta=D [margin=M]")
    args = ap.parse_args(argv)
    if args.last < 1:
        raise UserError(f"--last {args.last}: must be at least 1")
    if args.margin is not None and not args.margin > 0:
        raise UserError(f"--margin {args.margin}: must be > 0 (the smallest difference that matters)")
    if (args.baseline or args.margin is not None or args.outcome) and not args.group_by:
        raise UserError("--baseline, --margin and --outcome compare cells: give --group_by KEY... too")
    if args.plot is not None and args.plot.exists():
        raise UserError(f"--plot {args.plot} exists: choose another file, or delete it first")
    try:
        args.reduce = Reduction.parse({"mean_last": int(args.reduce.split(":", 1)[1])}
                                      if args.reduce.startswith("mean_last:") else args.reduce)
    except ValueError as err:
        raise UserError(f"--reduce {args.reduce}: {err}") from None
    args.outcomes = outcome_flags(args.outcome)
    runs = [RunDir(path).require_logged() for path in args.runs]
    args.metric, why = choose_metric(runs, args.metric)
    if args.group_by:
        text = grouped(runs, args)
    else:
        text = summary_table(runs, [summary(r, args.last, args.metric) for r in runs], args.last, args.metric)
    sys.stdout.write(f"{why}\n\n{text}" if why else text)
    if args.plot is not None:
        _plot(runs, args)
        sys.stdout.write(f"\nloss against tokens: {args.plot}\n")
    return 0


def _plot(runs: list[RunDir], args: argparse.Namespace) -> None:
    if args.group_by:
        from training.sweep import plots
        from training.sweep.analysis import cells_of

        plots.curves(cells_of(group(runs, args.group_by, args.metric, args.reduce)), plots.curve_tags(args.metric),
                     args.plot)
    else:
        plot(runs, args.plot, args.metric)
