"""Adding a placement the way a user would: one class and one registry entry, no other edit anywhere.

The example is DeepNorm (Wang et al. 2022, "DeepNet"): N(α·x + f(x)), a post-norm that up-weights the stream
by α = (2L)^¼ for a decoder of L blocks. It is registered for the test only (monkeypatch undoes it); the model
builds from a config naming it, trains (a Lightning step, probes on), and passes the same checks the
registry-driven matrix, structure and probe tests run on every built-in placement.
"""

import pytest
import torch

from model import Transformer
from model.config import INITS, QK_NORMS, ModelConfig
from model.norms import NORMS
from model.residual import PLACEMENTS, Placement, Sublayer
from tests.helpers.model import tiny_config
from tests.test_model_matrix import check_variant
from tests.test_model_probes import check_probes_cover_every_layer, check_residual_probes_match_float64
from tests.test_model_structure import check_blocks_equal_formulas, check_placement
from tests.test_training_hooks import STEPS, _fit_with_hook


class DeepNorm(Placement):
    """N(α·x + f(x)) — DeepNet: post-norm with the stream scaled up by α = (2L)^¼ (normlab has it as
    `residual_scale: deepnorm`; written out here as a user would add a placement)."""

    norms = ("norm_out",)  # built by Placement
    needs_final_norm = False  # the stream leaves every sublayer normalized
    adds_to_stream = False

    def __init__(self, cfg: ModelConfig, layer_id: int = 0, sublayer: str = "attn") -> None:
        super().__init__(cfg, layer_id, sublayer)
        self.alpha = (2 * cfg.n_layers) ** 0.25

    def formula(self, x: torch.Tensor, f: Sublayer) -> torch.Tensor:
        return self.norm_out(self.alpha * x + f(x))


@pytest.fixture
def deepnorm(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(PLACEMENTS, "deepnorm", DeepNorm)
    return "deepnorm"


def test_the_config_takes_its_names_and_norm_counts_from_the_registry(deepnorm):
    cfg = tiny_config(placement=deepnorm)
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert model.norm is None and not cfg.has_final_norm
    with pytest.raises(ValueError, match="'deepnorm'"):  # the valid names listed are the registry's
        tiny_config(placement="nope")


def test_it_trains_a_lightning_step_with_probes(deepnorm, tmp_path):
    seen, rows = _fit_with_hook(tmp_path, compile=False, probes=True, placement=deepnorm)
    assert len(seen) == STEPS
    losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    assert sum(bool(row.get("resid/update_ratio/mlp/L1")) for row in rows) == STEPS


@pytest.mark.parametrize("norm", sorted(NORMS))
def test_the_registry_checks_cover_it(deepnorm, norm):
    check_placement(deepnorm, norm)
    # one matrix case per norm, qk_norm and init rotating so that each of their values is met
    i = sorted(NORMS).index(norm)
    check_variant(norm, deepnorm, QK_NORMS[i % len(QK_NORMS)], INITS[i % len(INITS)])


def test_the_block_and_probe_checks_cover_it(deepnorm):
    check_blocks_equal_formulas(deepnorm)
    check_probes_cover_every_layer(deepnorm)
    check_residual_probes_match_float64(deepnorm)
