"""The 8-step reference runs of every checkpoint kind normlab writes — a 2-rank ZeRO-2 run (Lightning's own
launcher), 2-rank ZeRO-1 and ZeRO-3 runs (torchrun, which starts both ranks at once), the ZeRO-2 run's batches
in one plain process, and 2-rank DDP and FSDP2 runs (checkpoints every 3 steps: 3, 6 and the final 8) — trained
once per test session in one directory (the `zero_workdir` fixture of tests/conftest.py) and read by
tests/test_training_deepspeed.py, which checks them, tests/test_safe_loading.py, which crafts copies of their
checkpoints, tests/test_branch_deepspeed.py, which branches from the ZeRO-2 run,
tests/test_reliability_deepspeed.py, which resumes the ZeRO-1 run on one rank, tests/test_ddp.py and
tests/test_fsdp2.py, which checks FSDP2 against DDP.
A run costs a process start-up per rank, more than its training: training each once is what the sharing saves.
Readers must not write into these runs (copy them first); tests/test_training_deepspeed.py adds its evaluations."""
from __future__ import annotations

from pathlib import Path

from tests.helpers.multiproc import REPO, run_normlab, run_torchrun

HELPERS = REPO / "tests" / "helpers"


QK_CLIP = "0.03"  # τ below the tiny model's logits (~0.03–0.06): the clip scales some heads at every step


def fit_args(workdir: Path, name: str, stage: str, *extra: str, probe: str = "probe.yaml") -> list[str]:
    """`normlab fit` of the tiny run `name` in `workdir` on 2 ranks with `stage` (tests/helpers/tiny.yaml and the
    RNG probe, or another callbacks file), with QK-clip on, so that every stage's equality with one process covers
    its scaling of partitioned weights too."""
    return ["fit", "-c", str(HELPERS / "tiny.yaml"), "-c", str(HELPERS / probe), "--data.path", str(workdir / "tiny"),
            "--runs_dir", str(workdir / "runs"), "--name", name, "--trainer.strategy", stage,
            "--trainer.devices", "2", "--optim.qk_clip", QK_CLIP, *extra]


def train(workdir: Path, kind: str) -> Path:
    """Train the reference run `kind` (single, zero1, zero2, zero3, ddp or fsdp2) in `workdir`; returns its run
    directory."""
    if kind in ("ddp", "fsdp2"):
        run_normlab(fit_args(workdir, kind, kind, "--checkpoint.every_n_steps", "3"), cwd=workdir)
    elif kind == "zero2":
        run_normlab(fit_args(workdir, "zero2", "zero2"), cwd=workdir)
    elif kind in ("zero1", "zero3"):
        run_torchrun(fit_args(workdir, kind, kind), cwd=workdir)
    elif kind == "single":  # 2 ranks x 4 samples = 8 per micro-batch, in one process
        args = fit_args(workdir, "single", "auto", "--data.batch_size", "8")
        args[args.index("--trainer.devices") + 1] = "1"
        run_normlab(args, cwd=workdir)
    else:
        raise ValueError(kind)
    return workdir / "runs" / kind
