"""The plateau rule: a run whose final loss is within PLATEAU_NATS of the unigram entropy of its training tokens is
"plateau" (training.stats.training_outcome), that entropy counted from a prepared directory (data/entropy.py,
against a float64 −Σ p log p), and a study test whose arm stays on the plateau judged AT PLATEAU
(training/study/judge.py `judge_all`) — in process, on synthetic runs."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from data import layout
from data.entropy import COUNTS_FILE, token_counts, unigram_entropy
from training.errors import UserError
from training.stats import AT_PLATEAU, PASS, PLATEAU_NATS, training_outcome
from training.study import claims as claims_module
from training.study.grid import SCALES
from training.study.judge import judge_all, plateau_arms
from training.study.measure import outcome
from training.study.statistics import Context

SCALE = SCALES["quick"]
H = 6.3  # the study corpus's unigram entropy, about


def _prepared(root, tokens: list[int], vocab: int):
    """A prepared directory holding only what the entropy reads: meta.json and the train split."""
    root.mkdir()
    dtype = layout.token_dtype(vocab)
    np.asarray(tokens, dtype=dtype).tofile(root / "train.bin")
    meta = {"format": layout.FORMAT, "version": layout.VERSION, "vocab_size": vocab, "dtype": dtype.name,
            "splits": {"train": {"file": "train.bin", "tokens": len(tokens)}}}
    (root / layout.META_FILE).write_text(json.dumps(meta))
    return root


def _reference(tokens: list[int]) -> float:
    values, counts = np.unique(np.asarray(tokens), return_counts=True)
    p = counts.astype(np.float64) / counts.sum()
    return float(-(p * np.log(p)).sum())


def test_unigram_entropy_against_a_float64_reference(tmp_path):
    a = [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, 7]
    b = [4, 4, 5, 0]
    one = _prepared(tmp_path / "a", a, vocab=9)
    assert unigram_entropy([(one, 1.0)]) == pytest.approx(_reference(a), rel=1e-12)
    assert (one / COUNTS_FILE).is_file()  # counted once: the second call reads the cache ...
    assert unigram_entropy([(one, 1.0)]) == pytest.approx(_reference(a), rel=1e-12)
    assert token_counts(one).tolist() == np.bincount(a, minlength=9).tolist()
    (one / "train.bin").write_bytes(np.asarray(b, dtype=np.uint16).tobytes())  # ... until the split changes
    (one / layout.META_FILE).write_text((one / layout.META_FILE).read_text().replace('"tokens": 11', '"tokens": 4'))
    assert unigram_entropy([(one, 1.0)]) == pytest.approx(_reference(b), rel=1e-12)
    # a mixture: the weighted mixture of the sources' distributions (3:1), not of their pooled tokens
    two = _prepared(tmp_path / "b", a, vocab=9)
    mixed = 0.25 * np.bincount(b, minlength=9) / len(b) + 0.75 * np.bincount(a, minlength=9) / len(a)
    ref = float(-(mixed[mixed > 0] * np.log(mixed[mixed > 0])).sum())
    assert unigram_entropy([(one, 1.0), (two, 3.0)]) == pytest.approx(ref, rel=1e-12)


def test_the_plateau_rule_reads_the_final_loss_against_the_entropy():
    improved = [7.6, 6.1, 6.2, 6.3, 6.2, 6.15, 6.1, 6.1, 6.1, 6.1]  # a warm-up dip, then flat at H − 0.2
    early = min(improved[:2])
    assert early - improved[-1] < 0.1  # the rule this replaced ("< 0.1 nats of progress after 20%") said stalled
    assert training_outcome(improved, entropy=H) == "trains"
    flat = [7.6, 6.4, 6.35, 6.3, 6.3, 6.3, 6.29, 6.3, 6.28, 6.28]
    assert training_outcome(flat, entropy=H) == "plateau"
    assert training_outcome(flat, final_loss=H - PLATEAU_NATS - 0.01, entropy=H) == "trains"  # held out decides
    assert training_outcome(flat, final_loss=H - PLATEAU_NATS, entropy=H) == "plateau"
    assert training_outcome(flat, True, entropy=H) == "diverged"
    with pytest.raises(ValueError, match="unigram entropy"):  # no silent guess at the plateau
        training_outcome(flat, entropy=math.nan)
    with pytest.raises(UserError, match="run `normlab study` again"):
        outcome({"losses": flat, "diverged_at": None, "val_loss": 6.3})


def _run(val: float) -> dict:
    return {"losses": [7.6] + [val] * 9, "diverged_at": None, "val_loss": val, "probes": {10: {}},
            "unigram_entropy": H}


def _claim12(a: list[float], b: list[float]):
    claim = claims_module.BY_NUMBER[12]  # deep-no-final vs deep-final: held-out loss, one configuration each
    roles = claim.setup(SCALE)
    ctx = Context(SCALE, roles, {roles["deep-no-final"]: [_run(x) for x in a],
                                 roles["deep-final"]: [_run(x) for x in b],
                                 roles["no-final"]: [_run(H - 1.0)] * 6, roles["final"]: [_run(H - 1.0)] * 6})
    return claim, ctx


def test_an_arm_on_the_plateau_is_judged_at_plateau():
    """Claim 12 (the final norm helps a deep pre-LN stack) passes when 'deep-final' is 0.3 nats below the plateau
    and the other arm 0.2 above that; with 'deep-final' on the plateau in 5 of 6 seeds the same difference reads
    AT PLATEAU (the claim too), and with 4 of 6 it is judged normally again."""
    offsets = [0.0, 0.02, -0.01, 0.01, -0.02, 0.015]
    below = [H - 0.3 + e for e in offsets]
    spread = [0.01, -0.01, 0.005, 0.0, -0.005, 0.002]  # the difference must vary: no spread gives no verdict
    claim, ctx = _claim12([x + 0.2 + d for x, d in zip(below, spread, strict=True)], below)
    ((verdict, outs),) = judge_all([claim], [ctx])
    assert verdict == PASS and outs[0].verdict == PASS and plateau_arms(ctx, claim.primary) == []

    on = [H + 0.01 + e for e in offsets[:5]] + [H - 0.3]  # 5 of 6 seeds on the plateau: ≥ 80%
    claim, ctx = _claim12([x + 0.2 for x in on], on)
    ((verdict, outs),) = judge_all([claim], [ctx])
    assert plateau_arms(ctx, claim.primary) == ["deep-no-final", "deep-final"]
    assert verdict == AT_PLATEAU and outs[0].verdict == outs[0].verdict_bh == AT_PLATEAU

    four = [H + 0.01 + e for e in offsets[:4]] + [H - 0.3, H - 0.31]  # 4 of 6: under the 80% of the rule
    claim, ctx = _claim12([H - 0.1 + e for e in offsets], four)
    ((verdict, outs),) = judge_all([claim], [ctx])
    assert plateau_arms(ctx, claim.primary) == [] and verdict != AT_PLATEAU and outs[0].verdict != AT_PLATEAU


def test_a_claim_with_one_primary_at_the_plateau_is_at_plateau():
    """A claim's verdict over several primaries: one on the plateau makes the claim AT PLATEAU, whatever the others
    say (a PASS beside it, or a FAIL), as the study's judging and the CSV re-judging both read it."""
    from training.stats import FAIL
    from training.study.judge import combine

    assert combine([PASS, AT_PLATEAU]) == combine([AT_PLATEAU, FAIL]) == AT_PLATEAU
    assert combine([PASS, PASS]) == PASS and combine([PASS, FAIL]) == FAIL
