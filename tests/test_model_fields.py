"""The field matrix: every case of tests/helpers/fields.py through the checks every model field must pass.

Per-field math (each field against its formula in float64) lives beside the field's own tests; this file checks
what every field shares: the parameter count from the config, a finite gradient for every parameter, causality,
meta-device construction + `to_empty` + `init_weights` equal to an eager build under the same seed (a value kept in
a buffer would be wiped by `to_empty`), HF export refused naming the field, and μP covered or refused in one line.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from model import Transformer
from model.hf_compat import hf_family
from tests.helpers.fields import FIELD_CASES, FieldCase
from tests.helpers.model import tiny_config

CASES = [pytest.param(case, id=case.id) for case in FIELD_CASES]


def _config(case: FieldCase, **more):
    return tiny_config(kernels="torch", **{**case.overrides, **more})


@pytest.mark.parametrize("case", CASES)
def test_count_gradients_and_causality(case: FieldCase):
    torch.manual_seed(0)
    cfg = _config(case)
    model = Transformer(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    assert torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    if not case.identity_at_init:
        assert all(p.grad.abs().sum() > 0 for p in model.parameters())
    t = 6  # changing token t+1 leaves the logits at positions ≤ t unchanged
    changed = tokens.clone()
    changed[:, t + 1] = (changed[:, t + 1] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, : t + 1], b[:, : t + 1])
    assert not torch.allclose(a[:, t + 1], b[:, t + 1])


@pytest.mark.parametrize("case", CASES)
def test_meta_device_build_equals_eager_build(case: FieldCase):
    cfg = _config(case)
    torch.manual_seed(7)
    eager = Transformer(cfg)
    with torch.device("meta"):
        meta = Transformer(cfg)
    meta.to_empty(device="cpu")
    torch.manual_seed(7)
    meta.init_weights()
    tokens = torch.randint(0, cfg.vocab_size, (2, 12))
    with torch.no_grad():
        assert torch.equal(eager(tokens), meta(tokens))
    want, got = eager.state_dict(), meta.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("case", CASES)
def test_export_is_refused_naming_the_field(case: FieldCase):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{case.field}="):
        hf_family(_config(case))


@pytest.mark.parametrize("case", CASES)
def test_mup_covers_the_field_or_refuses_it(case: FieldCase):
    if case.mup:
        cfg = _config(case, parametrization="mup", mup_base_width=16)
        model = Transformer(cfg)
        assert torch.isfinite(model(torch.randint(0, cfg.vocab_size, (1, 8)))).all()
    else:
        with pytest.raises(ValueError, match=rf"{case.field}.*mup|mup.*{case.field}"):
            _config(case, parametrization="mup", mup_base_width=16)
