"""Multi-process normlab jobs on a real two-node Slurm (tests/helpers/slurm.py: nodes n1 and n2 on this host), no
mock: each job is 2 ranks, one per node, started by `srun` from the shipped `scripts/slurm.sbatch` (or by the
sweep's own job array), and it survives its time-limit warning, pre-emption, a hung rank and a lost node.

The signals are sent by Slurm itself (`scancel --signal=...`), from inside a rank at a chosen phase of a step
(tests/helpers/callbacks.py: SignalJobDuring), so the race between a signal and the ranks' collectives is hit on
purpose — forward, backward, optimizer step, checkpoint save — instead of by luck. Every warned job must end with
the weights and optimizer state of the job that ran straight through, bit for bit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.multiproc import REPO, cpu_env, free_port
from tests.helpers.slurm import Cluster, slurm_cluster  # noqa: F401  (the session fixture)
from training.checkpointing.safe import safe_torch_load
from training.run.layout import REQUEUES_FILE, complete_checkpoints, step_of

pytestmark = pytest.mark.slow

STEPS = 16
TINY = REPO / "tests" / "helpers" / "tiny.yaml"


def callbacks_file(path: Path, *callbacks: tuple[str, dict]) -> Path:
    """A `-c` file attaching the test callbacks (tests/helpers/callbacks.py) to a run."""
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": [
        {"class_path": f"tests.helpers.callbacks.{name}", "init_args": args} for name, args in callbacks]}}))
    return path


def job_env(cluster: Cluster, **extra: str) -> dict[str, str]:
    """What a submitted job inherits (sbatch --export=ALL): this Python first on the PATH (`normlab`), the repo,
    one thread per rank, and MASTER_ADDR (the node names do not resolve; Lightning reads it first)."""
    return cpu_env(SLURM_CONF=str(cluster.conf), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), **extra)


def submit_fit(cluster: Cluster, work: Path, name: str, *fit_args: str, strategy: str = "zero2") -> str:
    """`sbatch scripts/slurm.sbatch` — the shipped script — as a 2-node CPU job; returns the job id."""
    out = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0",
                          "--cpus-per-task=1", "--time=20", f"--output={work / name}.out",
                          str(REPO / "scripts" / "slurm.sbatch"), "-c", str(TINY), "--data.path", str(work / "tiny"),
                          "--runs_dir", str(work / "runs"), "--name", name, "--trainer.accelerator", "cpu",
                          "--trainer.max_steps", str(STEPS), *fit_args],
                         capture_output=True, text=True, cwd=work, env=job_env(cluster, STRATEGY=strategy))
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job_end(cluster: Cluster, job: str, timeout: float) -> dict[str, str]:
    """Wait until Slurm no longer lists `job` as pending or running (requeues included); its final record."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        show = cluster.run("scontrol", "show", "job", "-o", job).stdout
        fields = dict(f.split("=", 1) for f in show.split() if "=" in f)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return fields
        time.sleep(1)
    cluster.run("scancel", job)
    raise AssertionError(f"job {job} did not end within {timeout:.0f} s: {show}")


def checkpoint_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint — weights and optimizer state; under DeepSpeed each rank's shard, under FSDP2
    each assembled — by file and key (the RNG states and counters are checked by the resume tests)."""
    found: dict[str, torch.Tensor] = {}

    def walk(value, key: str) -> None:
        if torch.is_tensor(value):
            found[key] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, f"{key}/{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{key}[{i}]")

    if (ckpt_dir / ".metadata").is_file():  # FSDP2's DCP shards: the weights and optimizer state, assembled
        from training.checkpointing import dcp

        return {f"{key}/{name}": t for key in ("state_dict", "optimizer_0")
                for name, t in dcp.model_state(ckpt_dir, key).items()}

    import deepspeed  # noqa: F401  (its shards' few classes are allowed once it is imported, as for every reader)

    for shard in sorted([*(ckpt_dir / "checkpoint").glob("*.pt"), *ckpt_dir.glob("model.ckpt")]):
        state = safe_torch_load(shard)  # weights-only, DeepSpeed's shards included
        if shard.name == "model.ckpt":
            state = {k: state[k] for k in ("state_dict", "optimizer_states")}
        walk(state, shard.name)
    return found


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def final(run_dir: Path) -> Path:
    ckpts = complete_checkpoints(run_dir)
    assert ckpts and step_of(ckpts[-1]) == STEPS, f"{run_dir} did not reach step {STEPS}: {ckpts}"
    return ckpts[-1]


@pytest.fixture(scope="module")
def work(slurm_cluster, tmp_path_factory) -> Path:  # noqa: F811
    from tests.helpers.data import make_tiny_corpus

    root = tmp_path_factory.mktemp("slurm2")
    make_tiny_corpus(root)
    return root


def straight_run(cluster: Cluster, work: Path, strategy: str) -> Path:
    """The reference: the same 2-node job under `strategy`, never signalled (trained once per module)."""
    run = work / "runs" / f"straight-{strategy}"
    if not complete_checkpoints(run):
        record = job_end(cluster, submit_fit(cluster, work, run.name, strategy=strategy), 300)
        assert record["JobState"] == "COMPLETED", (record, (work / f"{run.name}.out").read_text()[-3000:])
    return run


@pytest.fixture(scope="module")
def straight(slurm_cluster, work) -> Path:  # noqa: F811
    return straight_run(slurm_cluster, work, "zero2")


def test_a_warned_fit_saves_requeues_and_resumes_bit_for_bit_whatever_the_ranks_were_doing(
        slurm_cluster, work, straight):  # noqa: F811
    """USR1 to every task (what #SBATCH --signal=USR1@T sends), landing while rank 0 is in the forward, the backward,
    the optimizer step, then inside a checkpoint save: each time the ranks agree on a step, save it, rank 0
    requeues the job, and the requeued job resumes — four requeues, the straight job's final state, no
    Lightning `hpc_ckpt` anywhere, one requeue record per warning."""
    phases = ["forward", "backward", "optimizer", "save"]
    hooks = callbacks_file(work / "warn.yaml", ("SignalJobDuring", {"phases": phases}))
    job = submit_fit(slurm_cluster, work, "warned", "-c", str(hooks), "--checkpoint.every_n_steps", "4")
    record = job_end(slurm_cluster, job, 900)
    log = (work / "warned.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == str(len(phases)), (record, log[-4000:])
    run = work / "runs" / "warned"
    requeues = json.loads((run / REQUEUES_FILE).read_text())
    assert [r["restart"] for r in requeues] == list(range(len(phases))), requeues
    assert all(r["reason"] == "warned by SIGUSR1" for r in requeues)
    assert log.count("requeueing job") == len(phases) and "Traceback" not in log, log[-4000:]
    assert not list(run.rglob("hpc_ckpt*")), "Lightning's own SLURM handler saved a checkpoint"
    assert_same(checkpoint_tensors(final(run)), checkpoint_tensors(final(straight)))


def test_a_two_node_sweep_run_survives_its_warning_and_a_lost_node(slurm_cluster, work):  # noqa: F811
    """The README's cluster spec shape (`slurm: {nodes: 2}`, `trainer.num_nodes: 2`, ZeRO-2, through srun), three
    runs that compute the same thing: one runs straight; one gets the time-limit warning on its batch step
    (`--signal=B:USR1@T`), which the task passes to srun (never SIGTERM: srun would kill the ranks) and the fit
    saves, requeues and resumes; one loses node n2's processes to kill -9 mid-run, after which the task requeues
    the job and the run resumes from its last complete checkpoint. All three end with the same weights and
    optimizer state, bit for bit."""
    hooks = callbacks_file(work / "sweep-hooks.yaml",
                           ("SignalJobDuring", {"phases": ["backward"], "batch": True, "only_in": "window=11"}),
                           ("LoseNode", {"step": 6, "node": "n2", "only_in": "window=12"}))
    spec = work / "two.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "two", "runs_dir": str(work / "sweep runs"),  # (a space: the #SBATCH lines must quote it)
        "base": {"config": [str(TINY), str(hooks)],
                 "overrides": {"data.path": str(work / "tiny"), "trainer.max_steps": STEPS, "trainer.num_nodes": 2,
                               "trainer.devices": 1, "trainer.strategy": "zero2", "checkpoint.every_n_steps": 4}},
        "grid": {"throughput.window": [10, 11, 12]}, "seeds": [0],  # (the window only averages tokens/s)
        "slurm": {"nodes": 2, "gpus_per_node": 0, "time": "00:20:00", "signal_seconds": 60}}))
    env = job_env(slurm_cluster)
    env.pop("MASTER_PORT")  # each array task's own, from its job id (Lightning's SLURMEnvironment)
    out = subprocess.run([sys.executable, "-m", "training.cli", "sweep", str(spec), "--executor", "slurm", "--wait"],
                         capture_output=True, text=True, env=env, cwd=work, timeout=900)
    sweep = work / "sweep runs" / "two"
    logs = {p.name: p.read_text()[-3000:] for p in (sweep / "slurm").glob("*.out")}
    assert out.returncode == 0, (out.stdout, out.stderr, logs)
    runs = {w: sweep / f"window={w}" / "s0" for w in (10, 11, 12)}
    state = json.loads((sweep / "sweep.json").read_text())
    assert [(r["status"], r["step"]) for r in state["runs"]] == [("finished", STEPS)] * 3, (state, logs)
    assert not (runs[10] / REQUEUES_FILE).exists()
    warned, lost = (json.loads((runs[w] / REQUEUES_FILE).read_text()) for w in (11, 12))
    assert [r["reason"] for r in warned] == ["warned by SIGUSR1"], warned
    assert [r["reason"] for r in lost] == ["a rank was lost"] and lost[0]["step"] == 4, lost
    # The ranks got the warning (not srun a SIGTERM): they stopped, saved and requeued before Slurm's requeue ended
    # the step (srun's "forcing job termination" comes with the requeue, after the save).
    fit_log = (runs[11] / "fit.log").read_text()
    killed = fit_log.find("forcing job termination")
    assert "on SIGUSR1" in fit_log and (killed == -1 or fit_log.index("requeueing job") < killed), fit_log[-3000:]
    want = checkpoint_tensors(final(runs[10]))
    for w in (11, 12):
        assert_same(checkpoint_tensors(final(runs[w])), want)


def test_zero3_warned_then_preempted_saves_both_times_and_resumes_to_the_same_weights(
        slurm_cluster, work):  # noqa: F811
    """ZeRO-3 (parameters gathered by collectives inside the forward): the warning lands in a forward and the job
    is requeued; in the requeued job, SIGTERM to every task (pre-emption, `scancel --signal=TERM`) lands in an
    optimizer step: the ranks save the next step — each its own shards — and exit 0, and nothing is requeued
    (Slurm decides after a pre-emption). Resubmitted, the run ends with the straight ZeRO-3 job's state."""
    hooks = callbacks_file(work / "zero3.yaml",
                           ("SignalJobDuring", {"phases": ["forward", "optimizer"], "signals": ["USR1", "TERM"]}))
    job = submit_fit(slurm_cluster, work, "zero3", "-c", str(hooks), strategy="zero3")
    record = job_end(slurm_cluster, job, 600)
    log = (work / "zero3.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0" and record["Restarts"] == "1", \
        (record, log[-4000:])
    run = work / "runs" / "zero3"
    assert [r["restart"] for r in json.loads((run / REQUEUES_FILE).read_text())] == [0]
    assert "on SIGTERM" in log and log.count("requeueing job") == 1, log[-4000:]
    stopped = complete_checkpoints(run)[-1]
    assert step_of(stopped) < STEPS
    assert sorted(p.name for p in (stopped / "checkpoint").glob("zero_pp_rank_*optim_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    record = job_end(slurm_cluster, submit_fit(slurm_cluster, work, "zero3", strategy="zero3"), 300)
    assert record["JobState"] == "COMPLETED", (work / "zero3.out").read_text()[-3000:]
    assert_same(checkpoint_tensors(final(run)), checkpoint_tensors(final(straight_run(slurm_cluster, work, "zero3"))))


def test_fsdp2_warned_in_its_gradient_reduce_scatter_resumes_to_the_same_weights(slurm_cluster, work):  # noqa: F811
    """FSDP2 reduce-scatters each block's gradients from hooks inside the backward (as DDP all-reduces them): the
    warning lands there, on rank 1; the job saves its DCP shards, requeues and resumes to the straight FSDP2 job's
    weights and optimizer state, bit for bit."""
    hooks = callbacks_file(work / "fsdp2.yaml", ("SignalJobDuring", {"phases": ["backward"], "rank": 1}))
    job = submit_fit(slurm_cluster, work, "fsdp2", "-c", str(hooks), strategy="fsdp2")
    record = job_end(slurm_cluster, job, 600)
    log = (work / "fsdp2.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", (record, log[-4000:])
    assert log.count("requeueing job") == 1 and "Traceback" not in log, log[-4000:]
    run = work / "runs" / "fsdp2"
    assert json.loads((final(run) / "manifest.json").read_text())["format"] == "dcp"
    assert_same(checkpoint_tensors(final(run)), checkpoint_tensors(final(straight_run(slurm_cluster, work, "fsdp2"))))


def test_a_hung_rank_ends_the_job_within_the_timeout_with_one_line(slurm_cluster, work):  # noqa: F811
    """Rank 1 stops (SIGSTOP) mid-run: rank 0 waits in its next collective for `cluster.timeout_s`, then ends with
    one line naming itself, its node and the collective, and srun --kill-on-bad-exit ends the step — instead of
    the job holding its nodes until the time limit. (srun's termination also wakes the stopped rank, which then
    finds its peer gone and says so in its own one line.)"""
    hooks = callbacks_file(work / "hang.yaml", ("HangRank", {"step": 5, "rank": 1}))
    start = time.monotonic()
    job = submit_fit(slurm_cluster, work, "hung", "-c", str(hooks), "--cluster.timeout_s", "10")
    record = job_end(slurm_cluster, job, 300)
    elapsed = time.monotonic() - start
    log = (work / "hung.out").read_text()
    assert record["JobState"] == "FAILED", (record, log[-3000:])
    errors = [line for line in log.splitlines() if "normlab fit: error:" in line]
    assert errors and errors[0].startswith("normlab fit: error: rank 0 (node n1): the all_reduce collective waited "
                                           "10 s (cluster.timeout_s)"), log[-3000:]
    assert len(errors) <= 2 and all("another rank stopped responding" in e for e in errors), errors
    assert "Traceback" not in log and elapsed < 120, (elapsed, log[-3000:])
