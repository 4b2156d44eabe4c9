"""Downstream tasks in the training loop and over a run's history (`--eval.tasks`, `normlab evaluate --tasks` on a
run directory), on a local multiple-choice task: the loop's numbers equal those of the saved checkpoint, the
history skips what is scored, bits per byte against a float64 recomputation, 2-rank ZeRO-2 against one process."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.helpers.multiproc import REPO, run_normlab
from tests.helpers.runs import scalars
from tests.helpers.tasks import TASK, write_task

pytest.importorskip("lm_eval", reason='lm-evaluation-harness is the optional extra: pip install -e ".[eval]"')

TINY = REPO / "tests" / "helpers" / "tiny.yaml"


def fit_with_tasks(workdir: Path, name: str, *extra: str) -> Path:
    (workdir / f"tasks-{name}").mkdir()
    tasks = write_task(workdir / f"tasks-{name}")
    run_normlab(["fit", "-c", str(TINY), "--data.path", str(workdir / "tiny"), "--runs_dir", str(workdir / "runs"),
                 "--name", name, "--eval.tasks", TASK, "--eval.include_path", str(tasks),
                 "--eval.every_n_steps", "4", *extra], cwd=workdir, timeout=900)
    return workdir / "runs" / name


@pytest.fixture(scope="module")
def single(workdir) -> Path:
    """A tiny 8-step run scoring the task at steps 4 and 8 (its checkpoint steps)."""
    return fit_with_tasks(workdir, "single")


def results(run_dir: Path, step: int) -> dict:
    return json.loads((run_dir / "eval" / "lm_eval" / f"step-{step:08d}.json").read_text())


def test_in_loop_numbers_are_logged_and_equal_the_checkpoints(single, tmp_path):
    from training.eval.tasks import run_tasks

    tags = {metric: scalars(single, f"eval/{TASK}/{metric}") for metric in ("acc", "bpb")}
    assert sorted(tags["acc"]) == sorted(tags["bpb"]) == [4, 8]
    for step in (4, 8):
        loop = results(single, step)
        assert loop["checkpoint"] is None and loop["metrics"][TASK]["acc"] == pytest.approx(tags["acc"][step])
        assert loop["metrics"][TASK]["bpb"] == pytest.approx(tags["bpb"][step], rel=1e-6)
        offline = run_tasks(single / "checkpoints" / f"step-{step:08d}", [TASK], output=tmp_path / f"{step}.json",
                            include_path=str(single.parent.parent / "tasks-single"))["metrics"][TASK]
        assert offline["acc"] == loop["metrics"][TASK]["acc"]
        assert offline["bpb"] == pytest.approx(loop["metrics"][TASK]["bpb"], rel=1e-5, abs=1e-6)
    assert (single / "eval" / "lm_eval.csv").read_text().splitlines()[0] == "step,task,acc,acc_norm,bpb"


def test_history_skips_the_steps_already_scored(single, capsys):
    from training.eval.cli import main as evaluate_main

    include = str(single.parent.parent / "tasks-single")
    step4 = single / "eval" / "lm_eval" / "step-00000004.json"
    step8 = single / "eval" / "lm_eval" / "step-00000008.json"
    loop4, before8 = json.loads(step4.read_text()), step8.stat().st_mtime_ns
    step4.unlink()  # as if the loop had not scored step 4: the history scores it, and only it
    assert evaluate_main(["--checkpoint", str(single), "--tasks", TASK, "--include_path", include]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 4: ") and "step 8" not in out
    assert step8.stat().st_mtime_ns == before8
    again = json.loads(step4.read_text())
    assert again["checkpoint"].endswith("step-00000004") and again["settings"] == loop4["settings"]
    assert again["metrics"][TASK]["acc"] == loop4["metrics"][TASK]["acc"]
    assert again["metrics"][TASK]["bpb"] == pytest.approx(loop4["metrics"][TASK]["bpb"], rel=1e-5)
    rows = (single / "eval" / "lm_eval.csv").read_text().splitlines()[1:]
    assert [r.split(",")[:2] for r in rows] == [["4", TASK], ["8", TASK]]
    # Other settings are another evaluation: nothing is skipped.
    assert evaluate_main(["--checkpoint", str(single), "--tasks", TASK, "--include_path", include, "--limit",
                          "5"]) == 0
    assert capsys.readouterr().out.count("step ") == 2


def test_gold_bpb_equals_a_float64_recomputation(single, tmp_path):
    """bpb from the harness's log-likelihoods equals −log2 p(gold continuation | context) / UTF-8 bytes, averaged
    over the items, recomputed here in float64 from the model and the items' text."""
    from data.layout import load_tokenizer
    from training.checkpointing.load import load_checkpoint
    from training.eval.tasks import run_tasks

    ckpt = single / "checkpoints" / "step-00000008"
    include = single.parent.parent / "tasks-single"
    ours = run_tasks(ckpt, [TASK], output=tmp_path / "r.json", include_path=str(include))["metrics"][TASK]["bpb"]
    loaded = load_checkpoint(ckpt)
    model, tokenizer = loaded.model.double().eval(), load_tokenizer(loaded.tokenizer_path)
    per_item = []
    for line in (include / "items.jsonl").read_text().splitlines():
        item = json.loads(line)
        gold = item["choices"][item["answer"]]
        # Tokens as the harness forms a request: the continuation's ids are those that follow the context's in
        # the encoding of the whole text; an empty context is the BOS id (EOS without one).
        whole, context = tokenizer.encode_batch([item["question"] + gold, item["question"]])
        continuation = whole[len(context):]
        context = context or [tokenizer.bos_id if tokenizer.bos_id >= 0 else tokenizer.eos_id]
        # The model sees at most max_seq_len tokens: the context's start is cut, as the harness cuts it.
        ids = torch.tensor([(context + continuation)[-(model.cfg.max_seq_len + 1):]])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(ids[:, :-1]), dim=-1)[0, -len(continuation):]
        nll = -logprobs.gather(-1, ids[0, -len(continuation):, None]).sum().item()
        per_item.append(nll / math.log(2) / len(gold.encode("utf-8")))
    assert ours == pytest.approx(sum(per_item) / len(per_item), rel=1e-5)


@pytest.mark.slow
def test_two_rank_zero2_in_loop_equals_one_process_on_its_checkpoint(workdir, tmp_path):
    """The batches dealt out to two ZeRO-2 ranks and gathered give the numbers one process gets from the same
    weights (the run's checkpoint); every rank computes them, rank 0 records them once."""
    from training.eval.tasks import run_tasks

    run = fit_with_tasks(workdir, "zero2", "--trainer.devices", "2", "--trainer.strategy", "zero2",
                         "--trainer.accumulate_grad_batches", "1", "--trainer.max_steps", "4")
    loop = results(run, 4)["metrics"][TASK]
    offline = run_tasks(run / "checkpoints" / "step-00000004", [TASK], output=tmp_path / "r.json",
                        include_path=str(workdir / "tasks-zero2"))["metrics"][TASK]
    assert offline["acc"] == loop["acc"]
    assert offline["bpb"] == pytest.approx(loop["bpb"], rel=1e-5, abs=1e-6)
    assert sorted(scalars(run, f"eval/{TASK}/bpb")) == [4]


def test_bad_settings_are_one_line(workdir, capsys, monkeypatch):
    """`fit` with bad downstream settings: exit status 2 and one line, and no run directory (run in this process,
    through the console script's entry point `training.cli.main`: no process start-up for a refusal)."""
    from training.cli import main

    monkeypatch.delenv("NORMLAB_DEBUG", raising=False)
    (workdir / "tasks-bad").mkdir()
    tasks = write_task(workdir / "tasks-bad")
    base = ["fit", "-c", str(TINY), "--data.path", str(workdir / "tiny"), "--runs_dir", str(workdir / "runs"),
            "--name", "bad", "--trainer.max_steps", "1"]
    cases = {("--eval.tasks", TASK): "without eval.every_n_steps",
             ("--eval.tasks", "no_such_task", "--eval.every_n_steps", "1", "--eval.include_path", str(tasks)):
                 "unknown task 'no_such_task'"}
    for flags, message in cases.items():
        capsys.readouterr()
        rc = main([*base, *flags])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, err[-2000:]
        assert "Traceback" not in err
        assert not (workdir / "runs" / "bad").exists()  # nothing written: no events file of a run that never ran


def test_a_stop_signal_saves_the_step_and_skips_the_harness(workdir):
    """SIGTERM (or the cluster's warning) after step 5 of 8: the step is saved and the fit exits, without scoring
    the tasks at the step it stopped at (a time limit's warning leaves no time for the harness; the run resumes)."""
    hooks = workdir / "sigterm.yaml"
    hooks.write_text("trainer:\n  callbacks:\n    - class_path: tests.helpers.callbacks.SignalSelf\n"
                     "      init_args: {step: 5}\n")
    run = fit_with_tasks(workdir, "stopped", "-c", str(hooks))
    assert (run / "checkpoints" / "step-00000005" / "manifest.json").is_file()
    assert sorted(p.name for p in (run / "eval" / "lm_eval").glob("step-*.json")) == ["step-00000004.json"]


def test_task_files_are_never_read_from_a_run_or_checkpoint_directory(tmp_path, capsys):
    """A task YAML whose `!function` would import Python written beside it: under a run, under a checkpoint, or
    in a directory holding a run, the include path is refused in one line before the harness reads a file (the
    Python never runs); `--include_path`'s help says that task files are code."""
    from training.errors import UserError
    from training.eval.cli import main as evaluate_main
    from training.eval.tasks import TaskSet

    run = tmp_path / "runs" / "shared"
    ckpt = run / "checkpoints" / "step-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text('{"step": 2}')
    (run / "config.yaml").write_text("model: {}\n")
    marker = tmp_path / "MARKER"
    for tasks in (run / "tasks", ckpt / "tasks"):
        tasks.mkdir()
        write_task(tasks)
        (tasks / "evil.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef docs(d):\n    return d\n")
        with open(tasks / f"{TASK}.yaml", "a") as f:
            f.write("process_docs: !function evil.docs\n")
    for include, where in ((run / "tasks", f"is inside {run}"), (ckpt / "tasks", f"is inside {ckpt}"),
                           (tmp_path, f"holds {run}")):
        with pytest.raises(UserError, match=rf"^include_path: '{include}' {where}, a normlab run or checkpoint "
                                            r"directory; task YAML files can import and run Python \(`!function`\)"):
            TaskSet.load([TASK], include_path=str(include))
    assert not marker.exists()
    with pytest.raises(SystemExit):
        evaluate_main(["--help"])
    assert "`!function` imports Python from that directory and runs it" in " ".join(capsys.readouterr().out.split())
