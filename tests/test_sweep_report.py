"""The sweep report on real tiny `normlab fit` runs laid out as a sweep (`<sweep>/<cell>/s<seed>/` and
sweep.json): every number in report.md and runs.csv equals the one recomputed here from each run's own
TensorBoard event files (EventAccumulator directly, and scipy for the intervals), a diverged run is counted as
an outcome, `normlab compare --group-by` prints the same tables, and bad input is one line."""
from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest
import scipy.stats as scipy_stats

from tests.helpers.multiproc import REPO, run_normlab
from training.errors import UserError
from training.sweep.report import write_report

pytestmark = pytest.mark.slow

TINY = REPO / "tests" / "helpers" / "tiny.yaml"
HUGE_LR = 30.0  # AdamW takes steps of ~lr: at seed 0 the gradients become non-finite at step 5
# (cell, params, seed): 2 placements × 2 seeds at the default LR, and pre-norm at a huge LR that diverges
RUNS = [(f"placement={p},lr=0.001", {"model.placement": p, "optim.lr": 0.001}, s) for p in ("pre", "post")
        for s in (0, 1)] + [(f"placement=pre,lr={HUGE_LR!r}", {"model.placement": "pre", "optim.lr": HUGE_LR}, 0)]
BASELINE = "placement=pre,lr=0.001"


@pytest.fixture(scope="module")
def sweep(workdir: Path) -> Path:
    """runs/demo: the five runs trained for real, and the sweep.json the runner would write."""
    root = workdir / "runs" / "demo"
    entries = []
    for cell, params, seed in RUNS:
        overrides = [f"--{k}={v}" for k, v in params.items()]
        huge = params["optim.lr"] == HUGE_LR
        proc = run_normlab(["fit", "-c", str(TINY), "--data.path", str(workdir / "tiny"), "--runs_dir",
                            str(root / cell), "--name", f"s{seed}", f"--seed_everything={seed}", *overrides],
                           cwd=workdir, expect_ok=not huge)
        if huge:  # stopped by the non-finite guard: what `normlab sweep` records as diverged, in the run too
            assert proc.returncode != 0 and "NonFiniteError" in proc.stderr, proc.stderr[-2000:]
            (root / cell / f"s{seed}" / "sweep-run.json").write_text(json.dumps({"status": "diverged"}))
        entries.append({"cell": cell, "params": params, "seed": seed, "run_dir": f"{cell}/s{seed}",
                        "status": "diverged" if huge else "finished", "step": 4 if huge else 8, "command": []})
    entries.append({"cell": BASELINE, "params": RUNS[0][1], "seed": 2, "run_dir": f"{BASELINE}/s2",
                    "status": "pending", "step": 0, "command": []})  # not trained yet: listed, not counted
    state = {"name": "demo", "spec_path": "demo.yaml", "metric": "val/loss", "mode": "min", "baseline": BASELINE,
             "margin": 0.05, "lr_key": "optim.lr", "axes": ["model.placement", "optim.lr"], "runs": entries}
    (root / "sweep.json").write_text(json.dumps(state))
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


def test_report_numbers_equal_those_recomputed_from_the_event_files(sweep, tmp_path):
    out = write_report(sweep, tmp_path / "report")
    text = out.read_text()
    final = {(c, s): _events(sweep / c / f"s{s}", "val/loss")[-1] for c, _, s in RUNS}

    # runs.csv: every run's final metric exactly, the pending run listed without one
    rows = {(r["cell"], r["seed"]): r for r in csv.DictReader((tmp_path / "report" / "runs.csv").open())}
    for cell, _, seed in RUNS[:4]:
        assert float(rows[cell, str(seed)]["final"]) == final[cell, seed]
        assert rows[cell, str(seed)]["outcome"] == "trains" and rows[cell, str(seed)]["final_step"] == "8"
    assert rows[BASELINE, "2"]["status"] == "pending" and rows[BASELINE, "2"]["final"] == ""

    # per cell: mean ± sd and the 95% t-interval (scipy), over the two seeds
    cells = _section(text, "Cells")
    for cell in ("placement=pre,lr=0.001", "placement=post,lr=0.001"):
        xs = [final[cell, 0], final[cell, 1]]
        lo, hi = scipy_stats.t.interval(0.95, 1, loc=statistics.fmean(xs), scale=scipy_stats.sem(xs))
        row = _row(cells, cell)
        assert row[1:5] == ["2", "2 / 0 / 0", f"{statistics.fmean(xs):.4f} ± {statistics.stdev(xs):.4f} (n=2)",
                            f"[{lo:.4f}, {hi:.4f}]"]
        assert row[5] == f"s0: {xs[0]:.4f}, s1: {xs[1]:.4f}"

    # against the baseline: the paired difference and its interval (scipy's paired t-test)
    post, pre = ([final[c, s] for s in (0, 1)] for c in ("placement=post,lr=0.001", BASELINE))
    res = scipy_stats.ttest_rel(post, pre)
    ci = res.confidence_interval(0.95)
    row = _row(_section(text, "Against the baseline"), "placement=post,lr=0.001")
    assert row[1:4] == ["2 of 2", f"{statistics.fmean(post) - statistics.fmean(pre):+.4f}",
                        f"[{ci.low:+.4f}, {ci.high:+.4f}]"]
    # two cells compared: Holm doubles the smaller p-value (here the larger one is NaN or larger)
    assert row[4].split(", ")[0] == f"{res.pvalue:.3g}"


def test_a_diverged_run_is_an_outcome_not_a_number(sweep, tmp_path):
    text = write_report(sweep, tmp_path / "report").read_text()
    huge = f"placement=pre,lr={HUGE_LR!r}"
    assert _events(sweep / huge / "s0", "val/loss")  # validated at step 4, before it diverged: not its result
    row = _row(_section(text, "Cells"), huge)
    assert row[1:5] == ["1", "0 / 0 / 1", "—", "—"] and row[5] == "s0: diverged"
    # against the baseline: no pair with two numbers, one seed diverged here only — never EQUIVALENT
    row = _row(_section(text, "Against the baseline"), huge)
    assert row[1] == "0 of 1" and row[6].startswith("1 / 0: 1, ") and row[7] == "**INCONCLUSIVE**"
    rows = {(r["cell"], r["seed"]): r for r in csv.DictReader((tmp_path / "report" / "runs.csv").open())}
    assert rows[huge, "0"]["outcome"] == "diverged" and rows[huge, "0"]["final"] == ""

    # the LR table: pre-norm's best LR is the default one, and its LR sensitivity (Wortsman et al.) counts the
    # diverged run as the initial loss — the median of the group's first logged train/loss values
    firsts = [_events(sweep / c / f"s{s}", "train/loss")[0] for c, p, s in RUNS if p["model.placement"] == "pre"]
    cap = statistics.median(firsts)
    good = _events(sweep / BASELINE / "s0", "val/loss")[-1]
    row = _row(_section(text, "Learning rate"), "placement=pre")
    assert row[1] == "0.001"
    assert row[4] == f"{(min(good, cap) + cap) / 2 - min(good, cap):.4f} (one seed)"


def test_a_run_the_runner_recorded_as_diverged_has_no_number(sweep, tmp_path):
    # (a run the non-finite guard stopped: `normlab sweep` records it as diverged, whatever it logged before)
    state = json.loads((sweep / "sweep.json").read_text())
    runs = [{**r, "status": "diverged"} if (r["cell"], r["seed"]) == (BASELINE, 1) else r for r in state["runs"]]
    text = write_report(_variant(sweep, tmp_path / "v", runs=runs)).read_text()
    row = _row(_section(text, "Cells"), BASELINE)
    s0 = _events(sweep / BASELINE / "s0", "val/loss")[-1]
    assert row[2] == "1 / 0 / 1" and row[5] == f"s0: {s0:.4f}, s1: diverged"
    row = _row(_section(text, "Against the baseline"), "placement=post,lr=0.001")
    assert row[1] == "1 of 2" and row[6].startswith("0 / 1: 1, ") and row[7] == "**INCONCLUSIVE**"


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
    dirs = [str(sweep / c / f"s{s}") for c, _, s in RUNS]
    assert main(["compare", *dirs, "--group-by", "model.placement", "optim.lr", "--baseline", BASELINE,
                 "--margin", "0.05", "--plot", str(tmp_path / "c.png")]) == 0
    printed = capsys.readouterr().out
    for title in ("Cells", "Against the baseline", "Learning rate"):
        assert _section(printed, title).split("\n\n")[1] == _section(report, title).split("\n\n")[1], title


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
    ({"metric": "val/lsos"}, "metric 'val/lsos' is logged by none of the 5 runs that finished or diverged; choose"),
    ({"baseline": "placement=mid"}, "baseline 'placement=mid' is not a cell; choose one of"),
    ({"margin": -1}, "margin -1 must be a number > 0"),
    ({"mode": "lowest"}, "mode 'lowest' must be one of"),
])
def test_bad_input_is_one_line(sweep, tmp_path, fields, message, capsys):
    from training.errors import report

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
    row = _row(_section(text, "Against the baseline"), "placement=post,lr=0.001")
    assert row[5] == "—, —" and row[7] != "**EQUIVALENT**"
