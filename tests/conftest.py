"""Test-session setup shared by every test module."""
import os
import shutil
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
