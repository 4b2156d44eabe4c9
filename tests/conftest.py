"""Test-session setup shared by every test module."""
import os
import shutil

# Without a GPU the fused Triton kernels run in Triton's interpreter, which must be switched on before anything
# imports triton (DeepSpeed does, at import). With a GPU the kernels run natively.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Everything the tests load is built locally: never reach for the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
