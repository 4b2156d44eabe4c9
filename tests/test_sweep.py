"""`normlab sweep`, local executor, on real tiny fit runs: kill -9 and rerun, idempotency, spec-edit refusal,
dry-run, status, divergence, bad specs."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from training.cli import main
from training.run.layout import complete_checkpoints
from training.sweep.spec import load_spec
from training.sweep.state import run_status

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
STEPS = 16


def write_spec(work: Path, name: str, **changes) -> Path:
    spec = {"name": name, "runs_dir": str(work / "runs"),
            "base": {"config": [str(work / "tiny.yaml")],
                     "overrides": {"data.path": str(work / "tiny"), "trainer.max_steps": STEPS}},
            "grid": {"model.placement": ["pre", "post"]}, "seeds": [0, 1], "baseline": "placement=pre",
            "margin": 0.05, **changes}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def sweep(spec: Path, *args: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "training.cli", "sweep", str(spec), *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    """The model and optimizer tensors of the run's final checkpoint (everything training carries on with)."""
    ckpt = torch.load(run_dir / "checkpoints" / f"step-{STEPS:08d}" / "model.ckpt", map_location="cpu",
                      weights_only=True)
    tensors = dict(ckpt["state_dict"])
    for i, opt in enumerate(ckpt["optimizer_states"]):
        for p, st in opt["state"].items():
            tensors.update({f"opt{i}.{p}.{k}": v for k, v in st.items() if torch.is_tensor(v)})
    return tensors


def files(run_dir: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file of the run's complete checkpoints: inode, mtime and content — a retrained or rewritten file
    changes them. (A save that kill -9 interrupted is not one: the resumed fit moves it aside.)"""
    return {str(p.relative_to(run_dir)): (p.stat().st_ino, p.stat().st_mtime_ns, p.read_bytes())
            for ckpt in complete_checkpoints(run_dir) for p in sorted(ckpt.rglob("*")) if p.is_file()}


def attempts(run_dir: Path) -> int:
    """How many times the sweep started the run's fit (its log has a header per attempt)."""
    return (run_dir / "fit.log").read_text().count("=== sweep attempt ")


@pytest.fixture(scope="module")
def work(workdir: Path) -> Path:
    shutil.copy(HELPERS / "tiny.yaml", workdir / "tiny.yaml")
    return workdir


@pytest.fixture(scope="module")
def reference(work: Path) -> Path:
    """An uninterrupted 2 cells × 2 seeds sweep."""
    spec = write_spec(work, "ref")
    proc = sweep(spec, "--max_parallel", "2")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out
    (work / "ref.out").write_text(out)
    return spec


@pytest.mark.slow
def test_a_local_sweep_prints_one_line_per_event_of_each_run(work, reference):
    """Each run's start, start-up, checkpoints and end as they happen, with its step and the sweep's standing."""
    lines = [ln.split("] ", 1)[1] for ln in (work / "ref.out").read_text().splitlines()
             if "training.sweep.local]" in ln]
    runs = [r.rel for r in load_spec(reference).runs()]
    for rel in runs:
        mine = [ln.split("  | ")[0].split("  ")[1:] for ln in lines if ln.startswith(f"{rel}  ")]
        assert mine[0][0] == "started" and mine[0][1].startswith("step 0, "), mine
        assert mine[-1][0].startswith("finished (start-up ") and mine[-1][1].startswith(f"step {STEPS}/{STEPS}, ")
        assert {m[0].split(" ")[0] for m in mine[1:-1]} <= {"up", "checkpoint"}, mine
        assert len(mine) <= 2 + 1 + STEPS // 4, mine  # quiet: start, start-up, a checkpoint each, end
    assert re.search(r"\| sweep 0/4 done \(\d running, \d pending\), ETA \?$", lines[0])  # nothing to go by yet
    assert lines[-1].endswith("| sweep 4/4 done (4 finished)")
    first_end = next(i for i, ln in enumerate(lines) if " finished (" in ln)
    assert all(re.search(r"ETA \d+(s|m\d\ds)$", ln) for ln in lines[first_end:] if "pending" in ln), lines


@pytest.mark.slow
def test_kill_9_mid_sweep_then_rerun_resumes_and_matches_the_uninterrupted_sweep(work, reference):
    spec = write_spec(work, "killed")
    sweep_dir = work / "runs" / "killed"
    runs = [r.rel for r in load_spec(spec).runs()]
    proc = sweep(spec, "--max_parallel", "2", start_new_session=True)
    # Kill once a run has finished and another is part-way (a complete checkpoint short of the end).
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        states = [run_status(sweep_dir / r) for r in runs]
        if any(s == "finished" for s, _, _ in states) and any(s != "finished" and 0 < step < STEPS
                                                               for s, step, _ in states):
            break
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    states = {r: run_status(sweep_dir / r) for r in runs}
    finished = [r for r, (s, _, _) in states.items() if s == "finished"]
    partial = [r for r, (s, step, _) in states.items() if s != "finished" and step > 0]
    assert finished and partial, states
    before = {r: files(sweep_dir / r) for r in finished}
    partial_ckpts = {r: files(sweep_dir / r) for r in partial}

    rerun = sweep(spec, "--max_parallel", "2")
    out, _ = rerun.communicate(timeout=900)
    assert rerun.returncode == 0, out
    for r in finished:  # not retrained, not even started again: the same files, inodes and times; one attempt
        assert files(sweep_dir / r) == before[r], r
        assert attempts(sweep_dir / r) == 1, r
    for r in partial:  # resumed: the checkpoints it had are kept as they were, the fit log shows a second attempt
        after = files(sweep_dir / r)
        assert all(after.get(f) == v for f, v in partial_ckpts[r].items()), r
        assert "sweep attempt 2" in (sweep_dir / r / "fit.log").read_text()
    state = json.loads((sweep_dir / "sweep.json").read_text())
    assert [(e["run_dir"], e["status"], e["step"]) for e in state["runs"]] == [(r, "finished", STEPS) for r in runs]
    for r in runs:  # bit for bit the uninterrupted sweep's weights and optimizer state
        got, want = final_state(sweep_dir / r), final_state(work / "runs" / "ref" / r)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), r


@pytest.mark.slow
def test_rerun_of_a_finished_sweep_trains_nothing_and_status_shows_every_run(work, reference, capsys):
    sweep_dir = work / "runs" / "ref"
    before = {r: files(sweep_dir / r) for r in ("placement=pre/s0", "placement=post/s1")}
    assert main(["sweep", str(reference)]) == 0
    assert {r: files(sweep_dir / r) for r in before} == before
    assert all(attempts(sweep_dir / r) == 1 for r in before)  # no fit was started for them
    capsys.readouterr()
    assert main(["sweep", str(reference), "--status"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["run", "status", "step", "time", "val/loss"]
    rows = {line.split()[0]: line.split()[1:] for line in out[1:5]}
    assert set(rows) == {"placement=pre/s0", "placement=pre/s1", "placement=post/s0", "placement=post/s1"}
    from tests.helpers.runs import scalars

    for rel, (status, step, seconds, metric) in rows.items():
        val = scalars(sweep_dir / rel, "val/loss")
        assert (status, step, metric) == ("finished", f"{STEPS}/{STEPS}", f"{val[max(val)]:.4f}")
        record = json.loads((sweep_dir / rel / "sweep-run.json").read_text())
        assert seconds == f"{round(record['ended'] - record['started'])}s"
    assert out[5] == "4/4 done (4 finished)"
    # a seed more: its runs' time is estimated from those this sweep has finished
    write_spec(work, "ref", seeds=[0, 1, 2])
    try:
        assert main(["sweep", str(reference), "--dry_run"]) == 0
    finally:
        write_spec(work, "ref")
    assert re.match(r"time: about \d+ s for 2 runs, 1 at a time — the mean wall time of this sweep's 4 finished "
                    r"runs \(\d+ s each\)", capsys.readouterr().out.splitlines()[-1])


@pytest.mark.slow
def test_a_spec_edit_that_changes_a_trained_run_is_refused_naming_it(work, reference, capsys):
    # New cells would be new runs; an edit of an existing run's arguments is what must be refused:
    changed = write_spec(work, "ref", base={"config": [str(work / "tiny.yaml")], "overrides": {
        "data.path": str(work / "tiny"), "trainer.max_steps": STEPS, "optim.lr": 0.01}})
    assert main(["sweep", str(changed), "--dry_run"]) == 0  # a dry-run only lists
    capsys.readouterr()
    assert main(["sweep", str(changed)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "placement=pre/s0" in err[0] and "--optim.lr=0.01" in err[0], err
    # ...and so is an edit of a -c file's contents.
    write_spec(work, "ref")
    tiny = work / "tiny.yaml"
    original = tiny.read_text()
    try:
        tiny.write_text(original + "# edited\n")
        assert main(["sweep", str(reference)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "tiny.yaml (file edited)" in err[0], err
    finally:
        tiny.write_text(original)
    # what the report judges is fixed once runs have trained: a new margin is refused, even by --status
    write_spec(work, "ref", margin=0.1)
    try:
        assert main(["sweep", str(reference), "--status"]) == 2
    finally:
        write_spec(work, "ref")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "margin was 0.05 when this sweep's runs trained" in err[0] and "is now 0.1" in err[0]


def test_dry_run_lists_every_run_and_its_exact_fit_command(work, capsys):
    spec = write_spec(work, "dry", grid={"model.placement": ["pre", "post"]},
                      zip={"optim.lr": [0.001, 0.003], "optim.min_lr": [0.0001, 0.0003]}, seeds=[3],
                      data_order="seed", baseline=None)
    assert main(["sweep", str(spec), "--dry_run", "--max_parallel", "2"]) == 0
    out = capsys.readouterr().out
    cells = ["placement=pre,lr=0.001,min_lr=0.0001", "placement=pre,lr=0.003,min_lr=0.0003",
             "placement=post,lr=0.001,min_lr=0.0001", "placement=post,lr=0.003,min_lr=0.0003"]
    *listed, estimate = out.splitlines()[1:]
    assert [line.split()[0] for line in listed[::2]] == [f"{c}/s3" for c in cells]
    # nothing has run: the time is calibrated here, one model per placement (the LR does not change a step's time)
    assert re.match(r"time: about \d+ s for 4 runs, 2 at a time — calibrated here, now: 2 model\(s\) timed over 2 "
                    r"fp32 training steps each on \d+ thread\(s\)", estimate), estimate
    sweep_dir = work / "runs" / "dry"
    assert (f"python -m training.cli fit -c {work}/tiny.yaml --data.path={work}/tiny --trainer.max_steps=16 "
            f"--model.placement=post --optim.lr=0.003 --optim.min_lr=0.0003 --data.seed=3 --seed_everything=3 "
            f"--runs_dir={sweep_dir}/placement=post,lr=0.003,min_lr=0.0003 --name=s3 --ckpt_path=last") in out
    assert not sweep_dir.exists()  # nothing written


@pytest.mark.parametrize("example", sorted((ROOT / "configs" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_example_specs_parse(example, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert main(["sweep", str(example), "--dry_run"]) == 0
    out = capsys.readouterr().out
    assert out.count("python -m training.cli fit") == len(load_spec(example).runs())


@pytest.mark.parametrize("change, message", [
    ({"grd": {}}, "unknown key 'grd'; valid keys: name"),
    ({"grid": {"model.placement": "pre"}}, "grid.model.placement must be a non-empty list"),
    ({"grid": {"model.placement": ["a/b"]}}, "value 'a/b' must be"),
    ({"grid": {"name": ["x"]}}, "the runner sets name itself"),
    ({"seeds": [0, 0]}, "seeds must be a list of distinct"),
    ({"baseline": "placement=mid"}, "baseline 'placement=mid' is not a cell; the cells are: placement=pre"),
    ({"zip": {"optim.lr": [1, 2], "optim.min_lr": [1]}}, "zip axes must have equal lengths"),
    ({"base": {"config": ["nope.yaml"]}}, "base.config file 'nope.yaml' does not exist"),
    ({"mode": "lowest"}, "mode 'lowest' is not one of ['min', 'max']"),
    ({"data_order": "paired"}, "data_order 'paired' is now called 'fixed'"),
    ({"question": "lr_sensitivity"}, "question 'lr_sensitivity' compares LR groups: give an lr_key"),
    ({"compare": ["placement=mid"]}, "compare entry 'placement=mid' is not a cell other than the baseline's; choose "
                                     "from: placement=post"),
    ({"metric": {"tag": "val/loss", "reduce": "median"}}, "reduce 'median' is not one of final, min, max"),
    ({"outcomes": {"spikes": {"window": 50}}}, "outcomes.spikes needs threshold (fixed before the runs)"),
])
def test_a_bad_spec_is_one_line_naming_the_field(work, change, message):
    spec = write_spec(work, "bad", **change)
    proc = sweep(spec, "--dry_run")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and out.count("\n") == 1, out
    assert out.startswith(f"normlab sweep: error: sweep spec '{spec}': ") and message in out, out


@pytest.mark.slow
def test_a_diverging_run_is_recorded_and_the_others_go_on(work):
    # lr 1e30: the first update blows the weights up, the next loss is not finite, and normlab's guard aborts.
    spec = write_spec(work, "div", grid={"optim.lr": [1.0e30, 0.001]}, seeds=[0], baseline=None,
                      base={"config": [str(work / "tiny.yaml")], "overrides": {
                          "data.path": str(work / "tiny"), "trainer.max_steps": 4}})
    proc = sweep(spec, "--max_parallel", "2")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out  # a divergence is an outcome of the sweep, not its failure
    state = json.loads((work / "runs" / "div" / "sweep.json").read_text())
    assert [(r["cell"], r["status"]) for r in state["runs"]] == [("lr=1e+30", "diverged"), ("lr=0.001", "finished")]
    record = json.loads((work / "runs" / "div" / "lr=1e+30" / "s0" / "sweep-run.json").read_text())
    assert "NonFiniteError" in record["error"], record


def test_the_sbatch_script_carries_the_specs_resources(monkeypatch, tmp_path):
    from training.sweep.slurm import script

    monkeypatch.chdir(ROOT)
    spec = load_spec(ROOT / "configs" / "sweeps" / "placement_lr_125m.yaml")
    lines = script(spec, tmp_path / "tasks.json", 18, None).splitlines()
    options = {line.removeprefix("#SBATCH ") for line in lines if line.startswith("#SBATCH ")}
    assert {"--array=0-17%6", "--nodes=1", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=8",
            "--time=06:00:00", "--partition=gpu", "--requeue", "--open-mode=append", "--signal=B:USR1@300",
            "--exclusive"} <= options
    assert lines[-2:] == ["source .venv/bin/activate",
                          f'exec {sys.executable} -m training.sweep.slurm {tmp_path}/tasks.json "$SLURM_ARRAY_TASK_ID"']
    assert "--array=0-17%3" in script(spec, tmp_path / "tasks.json", 18, 3)  # --max_parallel overrides


def test_the_sbatch_script_quotes_every_value_and_refuses_what_it_cannot_quote(monkeypatch, tmp_path):
    """A path with a space stays one option (sbatch reads double-quoted values: the 2-node Slurm test submits such a
    script for real); a value with a line break or a double quote would become another line or break the quoting:
    one error line naming it."""
    from training.errors import UserError
    from training.sweep.slurm import script

    work = tmp_path / "with space"
    work.mkdir()
    shutil.copy(HELPERS / "tiny.yaml", work / "tiny.yaml")
    monkeypatch.chdir(work)
    one = {"grid": {"optim.lr": [0.001]}, "seeds": [0], "baseline": None}
    spec = write_spec(work, "q", **one, slurm={"partition": "gpu", "time": "01:00:00"})
    options = [line for line in script(load_spec(spec), work / "tasks.json", 1, None).splitlines()
               if line.startswith("#SBATCH ")]
    assert f'#SBATCH --output="{work}/runs/q/slurm/%A_%a.out"' in options and f'#SBATCH --chdir="{work}"' in options
    assert "#SBATCH --partition=gpu" in options and "#SBATCH --time=01:00:00" in options
    for key, bad in (("partition", "gpu\n#SBATCH --qos=free"), ("account", 'a"b'), ("extra", ["--qos=x\nrm -rf ~"])):
        with pytest.raises(UserError, match=f"{key}.*(line break|double quote)"):
            script(load_spec(write_spec(work, "q", **one, slurm={key: bad})), work / "tasks.json", 1, None)


def test_a_bad_slurm_key_is_one_line(work):
    spec = write_spec(work, "badslurm", slurm={"gpus": 8})
    proc = sweep(spec, "--executor", "slurm")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2 and out.count("\n") == 1, out
    assert "unknown slurm key 'gpus'; valid: nodes, gpus_per_node" in out, out


def test_parallel_runs_get_disjoint_devices_or_cores(monkeypatch):
    from training.errors import UserError
    from training.sweep.local import slots

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert [s["env"] for s in slots(2)] == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    with pytest.raises(UserError, match="--max_parallel 5 needs at least as many GPUs; 4 are visible"):
        slots(5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: shares of the CPU cores
    cores = sorted(os.sched_getaffinity(0))
    assert slots(1) == [{"env": {}, "cpus": None}]
    shares = slots(len(cores))
    assert [s["cpus"] for s in shares] == [[c] for c in cores]
    assert all(s["env"]["OMP_NUM_THREADS"] == "1" for s in shares)


def test_an_array_task_refuses_a_run_whose_config_changed_since_submission(work, monkeypatch):
    """A Slurm task reads the spec when it starts: one whose spec or `-c` file was edited after `sbatch` would
    train (or resume) the run with a config it was not submitted with. It is refused in one line naming the run and
    what changed, before anything is written to the run."""
    from training.errors import UserError
    from training.sweep.slurm import task_main, tasks_document
    from training.sweep.state import write_json

    monkeypatch.chdir(work)
    spec_path = write_spec(work, "edited", grid={"optim.lr": [0.001]}, seeds=[0], baseline=None)
    tasks = work / "runs" / "edited" / "slurm" / "tasks.json"
    write_json(tasks, tasks_document(load_spec(spec_path), load_spec(spec_path).runs()))
    run_dir = work / "runs" / "edited" / "lr=0.001" / "s0"
    spec = yaml.safe_load(spec_path.read_text())
    spec["base"]["overrides"]["optim.warmup_steps"] = 5  # the spec edited after submission
    spec_path.write_text(yaml.safe_dump(spec))
    with pytest.raises(UserError, match=r"run lr=0.001/s0: its command changed since the array was submitted"):
        task_main([str(tasks), "0"])
    spec["base"]["overrides"].pop("optim.warmup_steps")
    spec_path.write_text(yaml.safe_dump(spec))
    config = work / "tiny.yaml"
    original = config.read_text()
    config.write_text(original + "\n# edited after submission\n")
    try:
        with pytest.raises(UserError, match=r"tiny.yaml \(edited\) changed since the array was submitted"):
            task_main([str(tasks), "0"])
    finally:
        config.write_text(original)
    assert not run_dir.exists()
