"""Read back what a normlab run wrote: TensorBoard scalars and consolidated weights."""
from __future__ import annotations

import re
from pathlib import Path

import torch


def scalars(run_dir: Path, tag: str) -> dict[int, float]:
    """{step: value} of `tag` as TensorBoard shows it (events purged by a restart are gone); a step that
    still appears twice is an error — that is exactly the duplicated/stale point a resume must not leave."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars(tag)
    steps = [e.step for e in events]
    assert len(steps) == len(set(steps)), f"{tag} has duplicated steps in {run_dir}: {steps}"
    return {e.step: e.value for e in events}


def consolidated_state_dict(ckpt_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The full fp32 weights of a normlab checkpoint directory (any ZeRO stage, or a Lightning file), with the
    LightningModule's `model.` prefix removed, so they load into `model.Transformer`. `scratch`: a directory
    for the consolidated file."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / "model.ckpt").is_file():
        state = torch.load(ckpt_dir / "model.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    else:
        out = Path(scratch) / f"{ckpt_dir.parent.parent.name}-{ckpt_dir.name}.pt"
        state = convert_zero_checkpoint_to_fp32_state_dict(str(ckpt_dir), str(out))["state_dict"]
    return {k.removeprefix("model."): v for k, v in state.items()}


def table_value(output: str, tag: str) -> float:
    """The number Lightning's results table (`normlab validate | test`) prints for `tag`: exactly one row."""
    found = re.findall(rf"{re.escape(tag)}\W+([0-9][0-9.e+-]*)", output)
    assert len(found) == 1, (tag, output[-3000:])
    return float(found[0])


def read_manifest(ckpt_dir: Path) -> dict:
    """A checkpoint's manifest.json as plain JSON, as a tool would read it (normlab reads it with `Manifest.read`)."""
    from training.run.manifest import Manifest

    return Manifest.read(ckpt_dir).to_dict()
