"""The registries' combinations: norm × placement × qk_norm × init, every triple of them in some case.

New entries in NORMS / PLACEMENTS / the config's choice tuples are picked up here automatically.
"""
import itertools

import pytest
import torch
import torch.nn.functional as F

from model import Transformer
from model.config import INITS, QK_NORMS
from model.norms import NORMS
from model.residual import PLACEMENTS
from tests.helpers.model import tiny_config


def covering(norms: list[str], placements: list[str]) -> list[tuple[str, str, str, str]]:
    """(norm, placement, qk_norm, init) cases in which every triple of values of three of the axes meets (a
    strength-3 covering array): the full product norm × placement × init, with qk_norm rotating so that each
    (norm, placement), (norm, init) and (placement, init) pair meets every qk_norm — a third of the full product."""
    return [(norm, placement, QK_NORMS[(a + b + c) % len(QK_NORMS)], init) for a, norm in enumerate(norms)
            for b, placement in enumerate(placements) for c, init in enumerate(INITS)]


MATRIX = covering(sorted(NORMS), sorted(PLACEMENTS))


def test_the_matrix_meets_every_triple_of_registry_values():
    axes = (sorted(NORMS), sorted(PLACEMENTS), QK_NORMS, INITS)
    for picked in itertools.combinations(range(4), 3):
        want = set(itertools.product(*(axes[k] for k in picked)))
        assert {tuple(case[k] for k in picked) for case in MATRIX} == want, picked


@pytest.mark.parametrize("norm, placement, qk_norm, init", MATRIX, ids=["-".join(c) for c in MATRIX])
def test_variant(norm, placement, qk_norm, init):
    check_variant(norm, placement, qk_norm, init)


def check_variant(norm: str, placement: str, qk_norm: str, init: str) -> None:
    """Parameter count from the config, shapes, finite loss, a gradient for every parameter, causality."""
    torch.manual_seed(0)
    cfg = tiny_config(norm=norm, placement=placement, qk_norm=qk_norm, init=init, kernels="torch")
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()

    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    logits = model(tokens)
    assert logits.shape == (2, 12, cfg.vocab_size)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert torch.isfinite(loss)

    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        if not _zero_grad_expected(name, init, placement):
            assert p.grad.abs().sum() > 0, name

    # Causality: changing token t+1 leaves logits at positions ≤ t unchanged.
    t = 6
    changed = tokens.clone()
    changed[:, t + 1] = (changed[:, t + 1] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1], b[:, t + 1])


def _zero_grad_expected(name: str, init: str, placement: str) -> bool:
    """With `init: zero` every sublayer outputs 0 at step 0, so nothing that only feeds a sublayer learns yet:
    its projections and QK-norms (all but the zeroed output projections), the norm it reads through, and the
    gain of a norm applied to its (zero) output (DyT's α too; its β does learn). A norm on the stream
    (post-norm's) does learn."""
    if init != "zero":
        return False
    inside_sublayer = (".attn." in name or ".mlp." in name) and not ("o_proj" in name or "down_proj" in name)
    on_stream = not PLACEMENTS[placement].adds_to_stream  # its norm_out normalizes the stream, not the update
    gain_on_zero = name.endswith(("norm_out.weight", "norm_out.alpha"))
    return inside_sublayer or "norm_in" in name or (gain_on_zero and not on_stream)
