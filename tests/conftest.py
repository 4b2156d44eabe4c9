"""Test-session setup shared by every test module."""
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest

# Without a GPU the fused Triton kernels run in Triton's interpreter, which must be switched on before anything
# imports triton (DeepSpeed does, at import). With a GPU the kernels run natively.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Everything the tests load is built locally: never reach for the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh directory for each test module that asks for it, holding the tiny prepared corpus at `tiny/`
    (tests/helpers/data.py); runs written there stay shared by the module's tests."""
    from tests.helpers.data import make_tiny_corpus

    root = tmp_path_factory.mktemp("work")
    make_tiny_corpus(root)
    return root


@pytest.fixture(scope="session")
def zero_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Like `workdir`, but one for the whole session: the home of the shared reference runs (below), so that
    modules reading them share one training of each."""
    from tests.helpers.data import make_tiny_corpus

    root = tmp_path_factory.mktemp("zero-runs")
    make_tiny_corpus(root)
    return root


def _reference_run(kind: str):
    """A session fixture: the 8-step reference run `kind` (tests/helpers/zero_runs.py), trained on first use."""
    @pytest.fixture(scope="session")
    def run(zero_workdir: Path) -> Path:
        from tests.helpers.zero_runs import train

        return train(zero_workdir, kind)
    return run


single_run, zero1_run, zero2_run, zero3_run, ddp_run, fsdp2_run = (
    _reference_run(kind) for kind in ("single", "zero1", "zero2", "zero3", "ddp", "fsdp2"))


@pytest.fixture(scope="session")
def docmask_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 4-step `normlab fit --data.document_mask true` on a corpus of short documents (most 32-token windows span
    several), with the probes every 2 steps and validation and a checkpoint at step 4: its training is checked by
    tests/test_docmask_training.py, its checkpoint evaluated by tests/test_eval_path.py. The corpus is the run's
    data.path (`docmask_run.parent.parent / "docs"`)."""
    from data.prepare import prepare
    from tests.helpers.multiproc import REPO, run_here
    from tests.test_docmask_data import short_documents

    root = tmp_path_factory.mktemp("docmask_fit")
    corpus = prepare([short_documents(root / "in", "docs", 300, 0)], output=root / "docs", vocab_size=300,
                     val_fraction=0.2)
    run_here(["fit", "-c", str(REPO / "tests" / "helpers" / "tiny.yaml"), "--data.path", str(corpus),
              "--data.document_mask", "true", "--runs_dir", str(root / "runs"), "--name", "docmask",
              "--trainer.max_steps", "4", "--data.seq_len", "32", "--metrics.every_n_steps", "2"])
    return root / "runs" / "docmask"


class _StderrNow(logging.StreamHandler):
    """A stream handler writing to whatever sys.stderr is at each record (capsys swaps it between phases)."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


@pytest.fixture
def lightning_to_capsys(capsys, monkeypatch) -> None:
    """Lightning's log lines (`Seed set to ...`, the accelerators found) on the stderr capsys captures, as a user's
    console gets them: outside pytest Lightning gives its loggers a stream handler of their own; under pytest,
    whose handlers the root logger holds, it lets them propagate there instead, out of capsys' sight."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "handlers", [_StderrNow()])
        monkeypatch.setattr(logger, "propagate", False)
