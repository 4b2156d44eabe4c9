"""The sweep report on a real local sweep of tiny `normlab fit` runs (`normlab sweep SPEC`, then `--report`):
every number in report.md and runs.csv equals the one recomputed here from each run's own TensorBoard event
files (EventAccumulator directly, and scipy for the intervals), a diverged run is counted as an outcome (the
worst value of its seed), the spec's question decides what is judged and Holm's family, the baseline that is the
best cell is flagged only when it was not fixed in the spec, `--plan` sizes the seeds from the sweep as a pilot,
`normlab compare --group_by` prints the same tables, the stability outcomes (spikes, the peak max logit, the LR
reach) are recomputed from the event files too, with 2 seeds no verdict is bold, and bad input is one line."""
from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import numpy as np
import pytest
import scipy.stats as scipy_stats
import yaml

from tests.helpers.multiproc import REPO, run_normlab
from training.errors import UserError
from training.stats import holm
from training.sweep.report import write_report

pytestmark = pytest.mark.slow

TINY = REPO / "tests" / "helpers" / "tiny.yaml"
HUGE_LR = 30.0  # AdamW takes steps of ~lr: the gradients become non-finite, the guard stops the run
# 2 placements × 2 LRs (the default, and one that diverges) × 2 seeds
CELLS = [(f"placement={p},lr={lr!r}", {"model.placement": p, "optim.lr": lr}) for p in ("pre", "post")
         for lr in (0.001, HUGE_LR)]
RUNS = [(cell, params, seed) for cell, params in CELLS for seed in (0, 1)]
BASELINE, HUGE, POST, POST_HUGE = (cell for cell, _ in CELLS)
OUTCOMES = {"spikes": {"window": 3, "threshold": 1.5, "margin": 1},  # 8 logged losses: a short window
            "max_logit_peak": {"margin": 0.01}, "lr_reach": {"delta": 0.05, "margin": 0.5}}


@pytest.fixture(scope="module")
def sweep(workdir: Path) -> Path:
    """runs/demo: the eight runs trained by `normlab sweep`, two at a time."""
    spec = {"name": "demo", "runs_dir": str(workdir / "runs"),
            "base": {"config": [str(TINY)], "overrides": {"data.path": str(workdir / "tiny"),
                                                          "metrics.every_n_steps": 4}},
            "grid": {"model.placement": ["pre", "post"], "optim.lr": [0.001, HUGE_LR]},
            "seeds": [0, 1], "metric": "val/loss", "mode": "min", "baseline": BASELINE, "margin": 0.05,
            "outcomes": OUTCOMES}
    (workdir / "demo.yaml").write_text(yaml.safe_dump(spec))
    run_normlab(["sweep", str(workdir / "demo.yaml"), "--max_parallel", "2"], cwd=workdir, timeout=900)
    root = workdir / "runs" / "demo"
    state = json.loads((root / "sweep.json").read_text())
    assert {(r["cell"], r["seed"]): r["status"] for r in state["runs"]} == {
        (c, s): "diverged" if p["optim.lr"] == HUGE_LR else "finished" for c, p, s in RUNS}
    return root


def _events(run_dir: Path, tag: str) -> list[float]:
    """The values of `tag` in step order, straight from the event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [e.value for e in sorted(acc.Scalars(tag), key=lambda e: e.step)]


def _row(report: str, first_cell: str) -> list[str]:
    lines = [line for line in report.splitlines() if line.startswith(f"| {first_cell} |")]
    assert lines, (first_cell, report)
    return [c.strip() for c in lines[0].strip("|").split("|")]


def _section(report: str, title: str) -> str:
    return report.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def _csv(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    return {(r["cell"], r["seed"]): r for r in csv.DictReader(path.open())}


def test_report_numbers_equal_those_recomputed_from_the_event_files(sweep):
    proc = run_normlab(["sweep", str(sweep.parents[1] / "demo.yaml"), "--report"], cwd=sweep.parents[1])
    out = sweep / "report" / "report.md"
    text = out.read_text()
    # the console gets the verdict tables, then where the whole report is
    assert proc.stdout.startswith("## Against the baseline") and proc.stdout.strip().endswith(f"report: {out}")
    assert _section(proc.stdout, "Against the baseline") == _section(text, "Against the baseline")
    final = {(c, s): _events(sweep / c / f"s{s}", "val/loss")[-1] for c, p, s in RUNS if p["optim.lr"] != HUGE_LR}

    # runs.csv: every run's final metric exactly, at the last step (8), and its outcome by the study's rule: on
    # the plateau when the held-out loss is within 0.05 nats of the unigram entropy each fit logged — the
    # entropy of the train split's tokens (float64, from the token file itself)
    meta = json.loads((sweep.parents[1] / "tiny" / "meta.json").read_text())
    tokens = np.fromfile(sweep.parents[1] / "tiny" / meta["splits"]["train"]["file"], dtype=meta["dtype"])
    p = np.bincount(tokens).astype(np.float64) / len(tokens)
    entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    rows = _csv(sweep / "report" / "runs.csv")
    outcomes = {}
    for cell, seed in final:
        assert _events(sweep / cell / f"s{seed}", "data/unigram_entropy") == [pytest.approx(entropy, rel=1e-6)]
        outcomes[cell, seed] = "plateau" if final[cell, seed] >= entropy - 0.05 else "trains"
        row = rows[cell, str(seed)]
        assert (float(row["final"]), row["final_step"]) == (final[cell, seed], "8")
        assert row["outcome"] == outcomes[cell, seed]
        assert row["run_dir"] == f"{cell}/s{seed}"

    # per cell: mean ± sd and the 95% t-interval (scipy), over the two seeds
    cells = _section(text, "Cells")
    for cell in (BASELINE, POST):
        xs = [final[cell, 0], final[cell, 1]]
        lo, hi = scipy_stats.t.interval(0.95, 1, loc=statistics.fmean(xs), scale=scipy_stats.sem(xs))
        counts = [sum(outcomes[cell, s] == o for s in (0, 1)) for o in ("trains", "plateau")]
        row = _row(cells, cell)
        assert row[1:5] == ["2", f"{counts[0]} / {counts[1]} / 0",
                            f"{statistics.fmean(xs):.4f} ± {statistics.stdev(xs):.4f} (n=2)", f"[{lo:.4f}, {hi:.4f}]"]
        assert row[5] == f"s0: {xs[0]:.4f}, s1: {xs[1]:.4f}"

    # against the baseline: the paired difference, its interval and p-value (scipy's paired t-test) and the
    # sign-flip p (two seeds: 4 sign patterns), Holm's correction across the question's 3 cells (the two
    # diverged ones: both seeds worse, a sign-flip p of 2/4)
    post, pre = ([final[c, s] for s in (0, 1)] for c in (POST, BASELINE))
    res = scipy_stats.ttest_rel(post, pre)
    ci = res.confidence_interval(0.95)
    d = [a - b for a, b in zip(post, pre, strict=True)]
    perm = 0.5 if d[0] * d[1] > 0 else 1.0
    row = _row(_section(text, "Against the baseline"), POST)
    assert row[1:4] == ["2 of 2", f"{statistics.fmean(post) - statistics.fmean(pre):+.4f}",
                        f"[{ci.low:+.4f}, {ci.high:+.4f}]"]
    adjusted = [holm([p, 0.5, 0.5])[0] for p in (res.pvalue, perm)]
    assert row[4] == f"{res.pvalue:.3g} / {perm:.3g}, {adjusted[0]:.3g} / {adjusted[1]:.3g}"


def test_a_diverged_run_is_an_outcome_not_a_number(sweep, tmp_path):
    text = write_report(sweep, tmp_path / "report").read_text()
    rows = _csv(tmp_path / "report" / "runs.csv")
    for cell in (HUGE, POST_HUGE):
        row = _row(_section(text, "Cells"), cell)
        assert row[1:6] == ["2", "0 / 0 / 2", "—", "—", "s0: diverged, s1: diverged"]
        # against the baseline: no pair with two numbers, two seeds diverged here only: the worst value on both
        # seeds (signed ranks: p = 2/4) — never EQUIVALENT, and too few seeds to call it WORSE
        row = _row(_section(text, "Against the baseline"), cell)
        assert row[1] == "0 of 2" and row[4].startswith("0.5 / 0.5, ") and row[6] == "2 / 0"
        assert row[5].startswith("—") and row[8].startswith("no verdict: 2 seeds, and the exact sign-flip test needs "
                                                             "≥ 7 to reach α/k = 0.0167")
        assert all(rows[cell, s]["outcome"] == "diverged" and rows[cell, s]["final"] == "" for s in ("0", "1"))

    # the LR table: each placement's best LR is the default one (at the grid's edge: unbracketed), and its LR
    # sensitivity (Wortsman et al.) counts each diverged run as its seed's loss at initialization
    for placement, good_cell in (("pre", BASELINE), ("post", POST)):
        per_seed = _sensitivities(sweep, placement, good_cell)
        lo, hi = scipy_stats.t.interval(0.95, 1, loc=statistics.fmean(per_seed), scale=scipy_stats.sem(per_seed))
        row = _row(_section(text, "Learning rate"), f"placement={placement}")
        assert row[1] == "0.001 (unbracketed: at the grid's edge)"
        assert row[4] == f"{statistics.fmean(per_seed):.4f}, [{lo:.4f}, {hi:.4f}]"


def _sensitivities(sweep: Path, placement: str, good_cell: str) -> list[float]:
    """Per seed, the LR sensitivity over {0.001, HUGE_LR} from the event files: the cap is the median of the
    seed's runs' step-1 train/loss (the loss at initialization, logged by every run, the diverged ones too)."""
    out = []
    for seed in (0, 1):
        firsts = [steps[0] for c, p, _ in RUNS[::2] if p["model.placement"] == placement
                  and (steps := _steps(sweep / c / f"s{seed}", "train/loss"))]
        assert all(step == 1 for step, _ in firsts)
        cap = statistics.median(v for _, v in firsts)
        good = min(_events(sweep / good_cell / f"s{seed}", "val/loss")[-1], cap)
        out.append((good + cap) / 2 - good)  # mean over the two LRs minus the best
    return out


def _steps(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return sorted((e.step, e.value) for e in acc.Scalars(tag))


def test_runs_the_runner_has_not_finished_are_listed_not_counted(sweep, tmp_path):
    state = json.loads((sweep / "sweep.json").read_text())
    status = {(BASELINE, 1): "diverged", (POST, 1): "pending"}  # (the guard stopped one; one not started yet)
    runs = [{**r, "status": status.get((r["cell"], r["seed"]), r["status"])} for r in state["runs"]]
    text = write_report(_variant(sweep, tmp_path / "v", runs=runs)).read_text()
    s0 = _events(sweep / BASELINE / "s0", "val/loss")[-1]
    row = _row(_section(text, "Cells"), BASELINE)
    assert row[1] == "2" and row[2].endswith(" / 1") and row[5] == f"s0: {s0:.4f}, s1: diverged"
    assert _row(_section(text, "Cells"), POST)[1] == "1"
    row = _row(_section(text, "Against the baseline"), POST)
    assert row[1] == "1 of 1" and row[8].startswith("no verdict: 1 seed,")  # one pair: no interval, no verdict
    assert f"`{sweep / POST / 's1'}` ({POST}): pending" in _section(text, "Not included")


def test_the_stability_outcomes_recomputed_from_the_event_files(sweep, tmp_path):
    """Spikes: the guard's z-score (window 3) replayed here in numpy over each run's logged train/loss; peak: the
    largest logged exact worst-head logit over layers and steps; both per run in runs.csv and per cell in the
    report; the spike comparison's exact p enumerated; the reach: each placement's best LR at the grid's edge (the
    other LR diverges), so its reach is a lower bound and no reach comparison is judged."""
    import numpy as np

    text = write_report(sweep, tmp_path / "r").read_text()
    rows = _csv(tmp_path / "r" / "runs.csv")
    spikes, peaks = {}, {}
    for cell, params, seed in RUNS:
        if params["optim.lr"] == HUGE_LR:
            continue
        run_dir = sweep / cell / f"s{seed}"
        losses = np.array(_events(run_dir, "train/loss"))
        z = [(x - losses[max(0, i - 3):i].mean()) / losses[max(0, i - 3):i].std(ddof=1)
             for i, x in enumerate(losses) if i >= 2]
        spikes[cell, seed] = sum(v > 1.5 for v in z)
        peaks[cell, seed] = max(v for layer in (0, 1) for v in _events(run_dir, f"attn/max_logit_exact_worst/L{layer}"))
        assert float(rows[cell, str(seed)]["spikes"]) == spikes[cell, seed]
        assert float(rows[cell, str(seed)]["max_logit_peak"]) == pytest.approx(peaks[cell, seed], rel=1e-6)
    row = _row(_section(text, "Stability: peak max attention logit"), POST)
    assert row[3] == f"s0: {peaks[POST, 0]:.4g}, s1: {peaks[POST, 1]:.4g}"
    spike_rows = _section(text, "Stability: loss spikes")
    d = [spikes[POST, s] - spikes[BASELINE, s] for s in (0, 1)]
    compared = _row(spike_rows.split("| cell − ", 1)[1], POST)
    if any(spikes[c, s] for c in (POST, BASELINE) for s in (0, 1)):
        exact = np.mean([abs(a * d[0] + b * d[1]) >= abs(sum(d)) for a in (1, -1) for b in (1, -1)])
        assert compared[4].startswith(f"{exact:.3g} / {exact:.3g}")
    else:
        assert compared[8] == "— (no spikes in either arm)"
    reach = _section(text, "Stability: LR reach")
    assert _row(reach, "placement=pre")[1] == "0.001 (unbracketed)" and _row(reach, "placement=pre")[2].startswith("≥")
    assert _row(reach.split("| group − ", 1)[1], "placement=post")[7].startswith("— (a reach is a lower bound")


def test_the_plots_and_files_are_written_whole(sweep, tmp_path):
    out = write_report(sweep, tmp_path / "r")
    names = sorted(p.name for p in out.parent.iterdir())
    assert names == ["curves.png", "lr.png", "report.md", "runs.csv"]  # no temporary file left behind
    for png in ("curves.png", "lr.png"):
        assert (out.parent / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert write_report(sweep) == sweep / "report" / "report.md"  # the default place


def test_compare_group_by_prints_the_reports_tables(sweep, tmp_path, capsys):
    from training.cli import main

    report = write_report(sweep, tmp_path / "report").read_text()
    dirs = [str(sweep / c / f"s{s}") for c, _, s in RUNS]  # the diverged ones too (their own record says so)
    outcomes = [arg for name, rule in OUTCOMES.items() for arg in ("--outcome", name, *(f"{k}={v}" for k, v in
                                                                                         rule.items()))]
    assert main(["compare", *dirs, "--group_by", "model.placement", "optim.lr", "--baseline", BASELINE,
                 "--margin", "0.05", *outcomes, "--plot", str(tmp_path / "c.png")]) == 0
    printed = capsys.readouterr().out
    for title in ("Cells", "Against the baseline", "Learning rate", "Stability: loss spikes",
                  "Stability: peak max attention logit", "Stability: LR reach"):
        assert _tables(_section(printed, title)) == _tables(_section(report, title)), title
    assert (tmp_path / "c.png").is_file()


def _tables(section: str) -> list[str]:
    """The Markdown tables of a section (a warning or note paragraph aside)."""
    return [p.strip() for p in section.split("\n\n") if p.startswith("|")]


def _variant(sweep: Path, root: Path, **fields) -> Path:
    """A sweep directory `root` whose sweep.json is the fixture's with `fields` changed, its runs pointing back
    at the fixture's run directories."""
    state = json.loads((sweep / "sweep.json").read_text())
    state.update(fields)
    state["runs"] = [{**r, "run_dir": str(sweep / r["run_dir"])} for r in state["runs"]]
    root.mkdir(parents=True)
    (root / "sweep.json").write_text(json.dumps(state))
    return root


@pytest.mark.parametrize("fields, message", [
    (None, "no sweep.json in"),
    ({"metric": "val/lsos"}, "metric 'val/lsos' is logged by none of the 8 runs that finished or diverged; choose"),
    ({"baseline": "placement=mid"}, "baseline 'placement=mid' is not a cell; choose one of"),
    ({"margin": -1}, "margin -1 must be a number > 0"),
    ({"mode": "lowest"}, "mode 'lowest' must be one of"),
    ({"question": "why"}, "question 'why' must be one of"),
])
def test_bad_input_is_one_line(sweep, tmp_path, fields, message, capsys):
    from training.errors import report_user_error as report

    root = tmp_path / "bad"
    if fields is None:
        root.mkdir()
    else:
        _variant(sweep, root, **fields)
    with pytest.raises(UserError, match=message) as err:
        write_report(root)
    assert report("sweep", err.value) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not (root / "report").exists()


def test_without_margin_or_lr_key(sweep, tmp_path):
    text = write_report(_variant(sweep, tmp_path / "v", margin=None, lr_key=None)).read_text()
    assert "no margin" in text and "no equivalence test" in text and "## Learning rate" not in text
    row = _row(_section(text, "Against the baseline"), POST)
    assert row[5] == "—, —" and row[8] != "**EQUIVALENT**"


def test_the_question_decides_what_is_judged(sweep, tmp_path):
    """question lr_sensitivity: the LR groups are judged (post's per-seed LR sensitivity − pre's, a paired
    t-test as scipy's), the cells against the baseline are shown but not judged; a family of one group."""
    text = write_report(_variant(sweep, tmp_path / "q", question="lr_sensitivity")).read_text()
    section = _section(text, "LR groups against `placement=pre`")
    rows = [line for line in section.splitlines() if line.startswith("| placement=post |")]
    sens, best = ([c.strip() for c in r.strip("|").split("|")] for r in rows)
    assert sens[1] == "LR sensitivity" and best[1].startswith("at its own best LR")
    post, pre = _sensitivities(sweep, "post", POST), _sensitivities(sweep, "pre", BASELINE)
    res = scipy_stats.ttest_rel(post, pre)
    assert sens[3] == f"{statistics.fmean(post) - statistics.fmean(pre):+.4f}"
    assert sens[6].startswith(f"{res.pvalue:.3g} / ") and sens[8].startswith("no verdict: 2 seeds")  # judged
    assert best[8] == "— (not the question)"
    assert _row(_section(text, "Against the baseline"), POST)[8] == "— (not the question)"
    assert "question `lr_sensitivity`" in text


def test_a_baseline_that_is_the_best_cell_is_flagged(sweep, tmp_path):
    finals = {c: statistics.fmean(_events(sweep / c / f"s{s}", "val/loss")[-1] for s in (0, 1))
              for c in (BASELINE, POST)}
    best, other = sorted(finals, key=finals.get)
    compare = {"compare": [other]}  # the diverged cells are no candidates
    # a baseline chosen after the runs (as `normlab compare --baseline` takes one) is flagged...
    flagged = write_report(_variant(sweep, tmp_path / "b", baseline=best, baseline_from=None, **compare)).read_text()
    assert f"**Warning:** the baseline `{best}` is the best of the 2 cells compared" in flagged
    # ...one the spec fixed before the runs is not: it cannot have been picked for winning
    fixed = write_report(_variant(sweep, tmp_path / "f", baseline=best, **compare)).read_text()
    assert "**Warning:**" not in fixed
    plain = write_report(_variant(sweep, tmp_path / "o", baseline=other, compare=[best])).read_text()
    assert "**Warning:**" not in plain
    assert _section(plain, "Against the baseline").count("| placement=") == 1  # only the family's cell


def test_plan_sizes_the_seeds_from_the_sweep_as_a_pilot(sweep):
    """`--plan` on the spec whose sweep ran: per cell of the question, the sd of its per-seed differences
    from the pilot, power and seeds needed at α/3 (three cells against the baseline)."""
    from training.stats import Estimate, power_at, seeds_needed

    proc = run_normlab(["sweep", str(sweep.parents[1] / "demo.yaml"), "--plan"], cwd=sweep.parents[1])
    out = proc.stdout
    assert "3 comparison(s) against `placement=pre,lr=0.001`, judged at α/k = 0.0167" in out
    d = [_events(sweep / POST / f"s{s}", "val/loss")[-1] - _events(sweep / BASELINE / f"s{s}", "val/loss")[-1]
         for s in (0, 1)]
    sd = statistics.stdev(d)
    row = _row(out, POST)
    power = power_at(Estimate(0.0, sd, 2, 0.0, 0.0, sd / 2 ** 0.5, 1), 0.05, 0.05 / 3)
    assert row[1] == f"{sd:.4g} (n=2)" and row[2] == f"{power:.0%}"
    assert row[4] == str(seeds_needed(sd, 0.05, 0.05 / 3) or "> 1000")
