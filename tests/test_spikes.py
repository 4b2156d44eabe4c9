"""Spike forensics (`guard.dump_spike_z`): a tiny single-process run with 10x loss spikes injected at updates 4, 8
and 12 (tests.helpers.faults.InjectLossSpike) and a z-score window of 3, so each spike stands far out against
the three losses before it. The dump's content is checked against numbers computed here independently: the
batches a test callback saw, the checkpoints before and after the spiking update (one per step), and a float64
re-computation of the spiked loss and its gradient."""
from __future__ import annotations

import json
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from lightning.pytorch import Callback
from safetensors.torch import load_file

from model import ModelConfig, Transformer
from model.names import layer_index
from tests.helpers.multiproc import REPO
from tests.helpers.runs import read_manifest, scalars
from training.callbacks.guard import NonFiniteGuard
from training.cli import main
from training.errors import DEBUG_ENV
from training.run import layout

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

HELPERS = REPO / "tests" / "helpers"
FACTOR, THRESHOLD = 10.0, 20.0


class RecordBatches(Callback):
    """Writes {"tokens" (and under document masking "position_ids"): {update number: its micro-batches
    [accumulate, B, T+1]}} to `path` when training ends."""

    def __init__(self, path: str) -> None:
        self.path, self.seen = path, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for key, value in (batch if isinstance(batch, dict) else {"tokens": batch}).items():
            self.seen.setdefault(key, {}).setdefault(trainer.global_step + 1, []).append(value.detach().clone())

    def on_train_end(self, trainer, pl_module) -> None:
        torch.save({k: {s: torch.stack(b) for s, b in steps.items()} for k, steps in self.seen.items()}, self.path)


def callbacks_config(tmp_path: Path, record: str) -> Path:
    path = tmp_path / f"{record}.yaml"
    path.write_text("trainer:\n  callbacks:\n"
                    "    - class_path: tests.helpers.faults.InjectLossSpike\n"
                    f"      init_args: {{steps: [4, 8, 12], factor: {FACTOR}}}\n"
                    "    - class_path: tests.test_spikes.RecordBatches\n"
                    f"      init_args: {{path: '{tmp_path / record}.pt'}}\n")
    return path


def fit(workdir: Path, name: str, tmp_path: Path, record: str, *extra: str) -> Path:
    """The tiny run with the spikes and a RecordBatches writing to `tmp_path/<record>.pt`."""
    with mock.patch.dict(os.environ, {DEBUG_ENV: "1"}):
        main(["fit", "-c", str(HELPERS / "tiny.yaml"), "-c", str(callbacks_config(tmp_path, record)), "--data.path",
              str(workdir / "tiny"), "--runs_dir", str(workdir / "runs"), "--name", name, "--trainer.devices", "1",
              "--metrics.every_n_steps", "0", "--trainer.max_steps", "12", "--checkpoint.every_n_steps", "1",
              "--guard.spike_window", "3", "--guard.dump_spike_z", str(THRESHOLD), "--guard.max_dumps", "2", *extra])
    return workdir / "runs" / name


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    path = layout.checkpoints_dir(run) / layout.step_dirname(step) / "model.ckpt"
    state = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    return {k.removeprefix("model."): v for k, v in state.items()}


def group(name: str) -> str:
    return f"L{layer_index(name)}" if layer_index(name) is not None else name.split(".")[0]


def group_norms(tensors: dict[str, torch.Tensor]) -> dict[str, float]:
    sq: dict[str, float] = {}
    for name, t in tensors.items():
        sq[group(name)] = sq.get(group(name), 0.0) + float((t.double() ** 2).sum())
    return {**{k: v ** 0.5 for k, v in sq.items()}, "global": sum(sq.values()) ** 0.5}


def reference_gradient(run: Path, step: int, tokens: torch.Tensor) -> tuple[list[float], dict[str, float]]:
    """The spiked update's micro-batch losses and per-group gradient norms, in float64, from the weights before
    it (checkpoint step - 1): Lightning's backward of FACTOR · loss / accumulation per micro-batch."""
    config = json.loads((layout.checkpoints_dir(run) / layout.step_dirname(step) / "model_config.json")
                        .read_text())
    model = Transformer(ModelConfig(**config)).double()
    model.load_state_dict({k: v.double() for k, v in weights(run, step - 1).items()}, strict=True)
    losses = []
    for micro in tokens:
        loss = FACTOR * model(micro[:, :-1], targets=micro[:, 1:])
        (loss / len(tokens)).backward()
        losses.append(loss.item())
    return losses, group_norms({n: p.grad for n, p in model.named_parameters()})


def test_a_spike_dumps_its_batch_gradient_and_update_norms(workdir, tmp_path, capsys):
    run = fit(workdir, "spiky", tmp_path, "first", "--trainer.max_steps", "6")  # dumps step 4, stops at 6
    fit(workdir, "spiky", tmp_path, "resumed", "--ckpt_path", "last",  # step 8 dumped, 12 over the cap of 2
        "--optim.continuation", "recompute")  # (the 12-step schedule the spikes were found with)
    log = capsys.readouterr().err  # (normlab's log lines go to stderr)
    spikes = run / "spikes"
    assert sorted(p.name for p in spikes.iterdir()) == ["step-00000004", "step-00000008"]  # no temporary left
    z = scalars(run, "guard/loss_z")
    assert z[4] > THRESHOLD and z[8] > THRESHOLD and z[12] > THRESHOLD  # 12 crossed too: the cap stopped it
    assert all(v < THRESHOLD for s, v in z.items() if s not in (4, 8, 12))
    assert log.count("loss spike at step") == 2 and f"{spikes / 'step-00000004'}" in log

    batches = {**torch.load(tmp_path / "first.pt", weights_only=True)["tokens"],  # steps 1-6
               **torch.load(tmp_path / "resumed.pt", weights_only=True)["tokens"]}  # steps 7-12
    for step in (4, 8):
        dump = spikes / layout.step_dirname(step)
        assert sorted(p.name for p in dump.iterdir()) == ["batch.safetensors", "spike.json"]
        record, tensors = json.loads((dump / "spike.json").read_text()), load_file(dump / "batch.safetensors")
        tokens = tensors["tokens"]
        assert tokens.shape == (1, 2, 4, 17) and tokens.dtype == torch.int64  # ranks, micro-batches, B, T+1
        assert torch.equal(tokens[0], batches[step])
        assert record["step"] == step and record["applied"] is True and record["threshold"] == THRESHOLD
        assert record["tokens_seen"] == (step - 1) * 2 * 4 * 16 and record["world_size"] == 1
        assert record["z"] == pytest.approx(z[step], rel=1e-6) and record["window"]["size"] == 3
        assert record["lr"] == pytest.approx(scalars(run, "train/lr")[step], rel=1e-6)

        losses, grads = reference_gradient(run, step, tokens[0])
        assert tensors["losses"][0].tolist() == pytest.approx(losses, rel=1e-5)
        assert record["loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)
        assert record["grad_norm"].keys() == grads.keys() >= {"L0", "L1", "tok_embeddings", "global"}
        for key, value in grads.items():
            assert record["grad_norm"][key] == pytest.approx(value, rel=1e-4), key

        before, after = weights(run, step - 1), weights(run, step)
        update = group_norms({k: after[k] - before[k] for k in before})
        params = group_norms(before)
        for key in update:
            assert record["update_norm"][key] == pytest.approx(update[key], rel=1e-6), key
            assert record["param_norm"][key] == pytest.approx(params[key], rel=1e-6), key
            assert record["update_ratio"][key] == pytest.approx(update[key] / params[key], rel=1e-6), key
        assert update["global"] > 0


def test_a_document_masked_spike_dumps_the_positions_it_ran_at(workdir, tmp_path):
    """Under data.document_mask the dump holds the step's position_ids beside its tokens (they mark the documents
    the model masked attention to), as the datamodule yielded them."""
    run = fit(workdir, "spiky-docs", tmp_path, "docs", "--data.document_mask", "true", "--trainer.max_steps", "4",
              "--checkpoint.every_n_steps", "0")
    tensors = load_file(run / "spikes" / "step-00000004" / "batch.safetensors")
    seen = torch.load(tmp_path / "docs.pt", weights_only=True)
    assert tensors.keys() == {"tokens", "position_ids", "losses"}
    assert torch.equal(tensors["tokens"][0], seen["tokens"][4])
    assert torch.equal(tensors["position_ids"][0], seen["position_ids"][4])
    positions = tensors["position_ids"]
    assert positions.shape == tensors["tokens"].shape and bool((positions[..., 0] == 0).all())  # windows start at 0


def test_a_failed_dump_leaves_nothing_half_written_and_training_goes_on(workdir, tmp_path, capsys):
    """A dump is written under a temporary name; when its batch file's write fails halfway (a full disk), no
    step-4 dump and no temporary directory remain, the failure is logged, and the run ends normally."""
    import safetensors.torch

    real, seen = safetensors.torch.save_file, []

    def half_then_full(tensors, path, *args, **kwargs):
        final = Path(path).parent.parent / "step-00000004"
        seen.append((Path(path).parent.name, final.exists()))  # where it writes; is the final name there yet?
        real(tensors, path, *args, **kwargs)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    with mock.patch.object(safetensors.torch, "save_file", half_then_full):
        run = fit(workdir, "full", tmp_path, "full", "--trainer.max_steps", "5", "--checkpoint.every_n_steps", "5")
    assert seen == [(".tmp-step-00000004", False)]
    assert not list((run / "spikes").iterdir())
    log = capsys.readouterr().err
    assert "could not write the spike dump of step 4" in log and "No space left" in log
    assert read_manifest(layout.checkpoints_dir(run) / "step-00000005")["step"] == 5


@pytest.mark.parametrize("kwargs, message", [
    ({"dump_spike_z": 0.0}, r"guard.dump_spike_z=0.0 must be > 0"),
    ({"dump_spike_z": 3.0, "max_dumps": 0}, r"guard.max_dumps=0 must be >= 1"),
])
def test_invalid_dump_options(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NonFiniteGuard(**kwargs)
