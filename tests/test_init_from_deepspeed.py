"""`fit --init_from` a Hugging Face model under 2-rank DeepSpeed ZeRO-2 and ZeRO-3 (real processes on CPU, fp32):
the step-0 distance to the source is 0 and, after an update with lr 1e-30, the consolidated checkpoint holds the
source's weights. Under ZeRO-3 the model is partitioned as it is built and rank 0 fills it one gathered
parameter at a time."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.multiproc import run_normlab
from tests.helpers.published import fit_args
from tests.helpers.runs import consolidated_state_dict, scalars
from tests.test_init_from import STEP1, world  # noqa: F401  (the module fixture)
from training.checkpointing import init_from

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_init_from_under_zero(stage, world, tmp_path):  # noqa: F811
    source = init_from.resolve(str(world["qwen3"]))
    args = fit_args(world["config"], world["data"], world["runs"], stage, "--init_from", str(world["qwen3"]),
                    "--trainer.devices", "2", "--trainer.strategy", stage)
    run_normlab(args, cwd=world["root"], timeout=600)
    run = world["runs"] / stage
    assert scalars(run, "surgery/kl")[0] == pytest.approx(0.0, abs=1e-10)
    assert scalars(run, "surgery/max_abs_logit_diff")[0] <= 1e-5
    assert scalars(run, "init/hf_max_abs_logit_diff")[0] <= 1e-5
    state = consolidated_state_dict(run / STEP1, tmp_path)
    expected = source.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k].float(), expected[k]) for k in expected)
