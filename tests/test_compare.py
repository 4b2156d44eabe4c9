"""`normlab compare` on two tiny real runs that differ in one setting."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.multiproc import REPO, run_here
from tests.helpers.runs import scalars
from training.compare import main

pytestmark = pytest.mark.slow

HELPERS = REPO / "tests" / "helpers"


@pytest.fixture(scope="module")
def runs(workdir: Path) -> Path:
    runs = workdir / "runs"
    for name, extra in (("rms", []), ("ln", ["--model.norm", "layernorm"])):
        run_here(["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
                  str(runs), "--name", name, "--metrics.every_n_steps", "2", *extra])
    return runs


@pytest.fixture(scope="module")
def unvalidated(runs: Path, workdir: Path) -> Path:
    """A run that never validated: it logs train/loss but no val/loss."""
    run_here(["fit", "-c", str(HELPERS / "tiny.yaml"), "--data.path", str(workdir / "tiny"), "--runs_dir",
              str(runs), "--name", "noval", "--trainer.limit_val_batches", "0"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(runs / "noval"))
    acc.Reload()
    assert "train/loss" in acc.Tags()["scalars"] and "val/loss" not in acc.Tags()["scalars"]
    return runs / "noval"


def _metrics(out: str) -> dict[str, list[str]]:
    metrics = out.split("final metrics")[1]
    return {line.split()[0]: line.split() for line in metrics.splitlines()[3:] if line.strip()}


def test_compare_two_runs(runs, workdir, tmp_path, capsys, monkeypatch):
    plot = tmp_path / "loss.png"
    assert main([str(runs / "rms"), str(runs / "ln"), "--last", "2", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    differences = out.split("final metrics")[0]

    # The one setting changed is the one difference (run names and directories are not differences), each run's
    # value as its model was built: the default's RMSNorm named, not the config's None ("the preset's")
    rows = [line.split() for line in differences.splitlines()[3:] if line.strip()]
    assert rows == [["model.norm", "rmsnorm", "layernorm"]]

    table = _metrics(out)
    for name in ("rms", "ln"):
        run = runs / name
        val = scalars(run, "val/loss")  # validated at steps 4 and 8
        last = {tag: (points := scalars(run, tag))[max(points)] for tag in ("resid/final_in", "resid/rms/L0")}
        resid = last["resid/final_in"] / last["resid/rms/L0"]
        peak = max(v for layer in (0, 1) for v in scalars(run, f"attn/max_logit_exact_worst/L{layer}").values())
        row = table[name]
        assert row[1] == f"{val[8]:.4f}"  # no ± : one run has no spread over seeds
        assert row[3:5] == ["8", f"{8 * 4 * 16 * 2:,}"]  # steps; tokens = steps x batch x seq_len x accumulation
        assert row[7:] == [f"{peak:.2f}", f"{resid:.2f}"]
    assert "tok/s*" in out and "MFU*" in out and "* measured on the machine, with its load, at the time" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the plot is written only where asked, and never over an existing file
    monkeypatch.chdir(tmp_path)
    assert main([str(runs / "rms"), str(runs / "ln")]) == 0 and sorted(p.name for p in tmp_path.iterdir()) == [
        "loss.png"]
    capsys.readouterr()

    from training.cli import main as normlab  # (a user error is printed by the one entry point)

    assert normlab(["compare", str(workdir / "tiny"), "--plot", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.startswith(f"normlab compare: error: '{workdir / 'tiny'}' is not a normlab run")
    assert not (tmp_path / "x.png").exists()


def test_the_metric_is_any_scalar_tag(runs, tmp_path, capsys):
    assert main([str(runs / "rms"), str(runs / "ln"), "--metric", "train/loss", "--last", "3",
                 "--plot", str(tmp_path / "p.png")]) == 0
    table = _metrics(capsys.readouterr().out)
    for name in ("rms", "ln"):
        train = scalars(runs / name, "train/loss")
        assert table[name][1] == f"{train[8]:.4f}"


@pytest.mark.parametrize("args, message", [
    (["--metric", "val/lsos"], "--metric 'val/lsos' is logged by none of the runs; choose a scalar tag they log"),
    (["--group_by", "model.nrom"], "--group_by model.nrom: no such key in"),
    (["--group_by", "optim.lr"], "are both lr=0.001 at seed_everything=1234: a cell needs one run per seed"),
    (["--baseline", "norm=None"], "--baseline, --margin and --outcome compare cells: give --group_by KEY... too"),
    (["--group_by", "model.norm", "--outcome", "spikes", "window=1", "threshold=3"],
     "--outcome: outcomes.spikes.window 1 must be >= 2"),
    (["--group_by", "model.norm", "--baseline", "norm=rms"], "baseline 'norm=rms' is not a cell"),
])
def test_bad_input_is_one_line(runs, tmp_path, capsys, args, message):
    from training.cli import main as normlab

    assert normlab(["compare", str(runs / "rms"), str(runs / "ln"), *args, "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("normlab compare: error: ") and message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "p.png").exists()


def test_an_existing_plot_is_not_overwritten(runs, tmp_path, capsys):
    from training.cli import main as normlab

    plot = tmp_path / "mine.png"
    plot.write_bytes(b"an earlier figure")
    assert normlab(["compare", str(runs / "rms"), str(runs / "ln"), "--plot", str(plot)]) == 2
    assert capsys.readouterr().err.strip() == (f"normlab compare: error: --plot {plot} exists: choose another file, "
                                               "or delete it first")
    assert plot.read_bytes() == b"an earlier figure"


def test_without_val_loss_it_compares_train_loss_and_says_so(runs, unvalidated, tmp_path, capsys):
    assert main([str(runs / "rms"), str(unvalidated), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f"metric: train/loss (val/loss is not logged by {unvalidated}; --metric chooses "
                                   "another)")
    table = _metrics(out)
    for run in (runs / "rms", unvalidated):
        assert table[run.name][1] == f"{scalars(run, 'train/loss')[8]:.4f}"
    assert (tmp_path / "p.png").is_file()

    # runs that all validate keep val/loss, without the line
    assert main([str(runs / "rms"), str(runs / "ln"), "--plot", str(tmp_path / "q.png")]) == 0
    assert capsys.readouterr().out.startswith("config differences")


def test_an_explicit_metric_no_run_logs_stays_an_error(unvalidated, tmp_path, capsys):
    from training.cli import main as normlab

    assert normlab(["compare", str(unvalidated), "--metric", "val/loss", "--plot", str(tmp_path / "p.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("normlab compare: error: --metric 'val/loss' is logged by none of the runs; choose a "
                          "scalar tag they log with --metric, e.g. ") and "train/loss" in err
    assert len(err.splitlines()) == 1 and not (tmp_path / "p.png").exists()
