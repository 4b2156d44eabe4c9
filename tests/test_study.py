"""`normlab study --quick`: the report has every claim, and its numbers are the runs' own; and each claim's verdict,
on synthetic statistics built to pass it and to fail it."""
import json
import math
import re
from dataclasses import replace

import pytest

from training import study as study_module
from training.study import SCALES, main


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    data = tmp_path_factory.getbasetemp() / "study-data"
    assert main(["--quick", "--output", str(out), "--data", str(data)]) == 0
    return out, json.loads((out / "results.json").read_text()), (out / "report.md").read_text()


def test_report_structure(study):
    out, results, report = study
    rows = re.findall(r"^\| (\d) \| .*? \| \*\*(PASS|FAIL)\*\* \| (.*) \|$", report, flags=re.M)
    assert [int(r[0]) for r in rows] == list(range(1, 9))
    for png in ("loss_curves.png", "residual_rms_vs_depth.png", "update_ratio_vs_depth.png",
                "grad_norm_at_init.png", "attention_saturation.png"):
        assert (out / png).stat().st_size > 1000
        assert f"]({png})" in report
    assert [c["passed"] for c in results["claims"]] == [r[1] == "PASS" for r in rows]


def test_numbers_come_from_the_runs(study):
    _, results, report = study
    scale = SCALES["quick"]
    runs = results["runs"]
    for name, run in runs.items():
        assert len(run["losses"]) == (run["diverged_at"] if run["diverged_at"] is not None else scale.steps)
        if run["diverged_at"] is None:
            tail = run["losses"][-max(1, len(run["losses"]) // 10):]
            assert f"| {sum(tail) / len(tail):.4f} |" in report.split(f"| {name} |")[1].split("\n")[0] + " |"
    # Claim 1 quotes the baseline's probe values at the last step.
    last = runs["pre-rms"]["metrics"][str(scale.steps)]
    rms = [last[f"resid/rms/L{l}"] for l in range(scale.n_layers)] + [last["resid/final_in"]]
    assert "[" + ", ".join(f"{x:.3g}" for x in rms) + "]" in results["claims"][0]["numbers"]
    # Claim 6 quotes the max attention logit of the no-QK-norm run.
    no_qk = runs["pre-rms-high-nowarm"]["metrics"]
    final = no_qk[max(no_qk, key=int)]
    peak = max(final[f"attn/max_logit/L{l}"] for l in range(scale.n_layers))
    assert f"without QK-norm {peak:.2f}" in results["claims"][5]["numbers"]
    assert all(math.isfinite(x) for x in runs["pre-rms"]["losses"])


# ---- the verdicts, on synthetic statistics ----------------------------------------------------------------------
SYNTH = replace(SCALES["quick"], n_layers=4, steps=10)


def synthetic_metrics(rms=(1.0, 2.0, 3.0, 4.0), final=5.0, ratio=(0.5, 0.4, 0.3, 0.2), logit=5.0, sat=0.1) -> dict:
    m = {"resid/final_in": final}
    for l in range(SYNTH.n_layers):
        m.update({f"resid/rms/L{l}": rms[l], f"resid/update_ratio/attn/L{l}": ratio[l],
                  f"resid/update_ratio/mlp/L{l}": ratio[l], f"attn/max_logit/L{l}": logit,
                  f"attn/saturated_frac/L{l}": sat})
    return m


def synthetic_results(**changes) -> dict[str, "study_module.Result"]:
    """Runs whose statistics pass every claim; `changes` replaces a run's fields (end: its metrics at the last
    step, start: at step 0)."""
    runs = {
        "pre-rms": dict(loss=3.0),
        "pre-rms-depth": dict(loss=3.0, end=synthetic_metrics(final=4.0)),  # growth 4/2 < the baseline's 5/2
        "pre-ln": dict(loss=3.03),  # within 2% of RMSNorm's 3.0
        "post-ln-high-nowarm": dict(loss=4.0),  # > 0.05 worse than pre-norm at the same settings
        "pre-rms-high-nowarm": dict(loss=3.5, end=synthetic_metrics(logit=10.0, sat=0.3)),  # logits grew from 5
        "pre-rms-qk-high-nowarm": dict(loss=3.5, end=synthetic_metrics(logit=6.0, sat=0.1)),
    }
    for name, fields in changes.items():
        runs[name] = {**runs[name], **fields}
    grid = {r.name: r for r in study_module.GRID}
    return {name: study_module.Result(grid[name], losses=[f["loss"]] * SYNTH.steps, diverged_at=f.get("diverged_at"),
                               metrics={0: f.get("start", synthetic_metrics()),
                                        SYNTH.steps: f.get("end", synthetic_metrics())})
            for name, f in runs.items()}


FLAT, STEEP = [1.0, 1.5, 1.2, 1.1], [1.0, 4.0, 2.0, 1.0]  # per-layer gradient norms at init: max/min 1.5 and 4


@pytest.mark.parametrize("claim, changes, grads, times", [
    (None, {}, (FLAT, STEEP), (0.9, 1.0)),
    # (claim 1's cases keep the depth-scaled run's growth below the baseline's, for claim 3)
    (1, {"pre-rms": dict(end=synthetic_metrics(final=3.9)), "pre-rms-depth": dict(end=synthetic_metrics(final=3.0))},
     (FLAT, STEEP), (0.9, 1.0)),  # 75% of steps up
    (1, {"pre-rms": dict(end=synthetic_metrics(rms=(1, 2, 3, 3.5), final=3.9)),
         "pre-rms-depth": dict(end=synthetic_metrics(final=3.0))}, (FLAT, STEEP), (0.9, 1.0)),  # all up, < 2x
    (2, {"pre-rms": dict(end=synthetic_metrics(ratio=(0.5, 0.2, 0.3, 0.4)))}, (FLAT, STEEP), (0.9, 1.0)),
    # second half below the first, but half the steps go up (> 40%)
    (2, {"pre-rms": dict(end=synthetic_metrics(ratio=(0.9, 0.5, 0.1, 0.3)))}, (FLAT, STEEP), (0.9, 1.0)),
    (3, {"pre-rms-depth": dict(end=synthetic_metrics(final=6.0))}, (FLAT, STEEP), (0.9, 1.0)),
    (4, {"post-ln-high-nowarm": dict(loss=3.52)}, (FLAT, STEEP), (0.9, 1.0)),
    (4, {"pre-rms-high-nowarm": dict(diverged_at=5, end=synthetic_metrics(logit=10.0, sat=0.3))}, (FLAT, STEEP),
     (0.9, 1.0)),
    (5, {}, (FLAT, [1.0, 2.5, 2.0, 1.0]), (0.9, 1.0)),  # post's spread 2.5 is not > 2x pre's 1.5
    (5, {}, ([1.0, 2.1, 1.0, 1.0], [1.0, 9.0, 1.0, 1.0]), (0.9, 1.0)),  # pre not flat (max/min 2.1)
    (6, {"pre-rms-qk-high-nowarm": dict(end=synthetic_metrics(logit=11.0, sat=0.1))}, (FLAT, STEEP), (0.9, 1.0)),
    (6, {"pre-rms-high-nowarm": dict(end=synthetic_metrics(logit=4.0, sat=0.3))}, (FLAT, STEEP), (0.9, 1.0)),
    (6, {"pre-rms-qk-high-nowarm": dict(end=synthetic_metrics(logit=6.0, sat=0.5))}, (FLAT, STEEP), (0.9, 1.0)),
    (7, {"pre-ln": dict(loss=3.1)}, (FLAT, STEEP), (0.9, 1.0)),  # 3.3% apart
    (7, {}, (FLAT, STEEP), (1.1, 1.0)),  # RMSNorm slower
])
def test_claim_verdicts_on_synthetic_statistics(monkeypatch, claim, changes, grads, times):
    """Statistics built to pass every claim pass; changing one run's statistics past one claim's threshold fails
    exactly that claim. (The measured parts — the init gradient profiles and step times — are given too.)"""
    monkeypatch.setattr(study_module, "init_grad_profile", lambda placement, scale: grads[placement == "post"])
    monkeypatch.setattr(study_module, "interleaved_step_times", lambda scale, data_vocab: times)
    verdicts = {c.number: c.passed for c in study_module.evaluate(synthetic_results(**changes), SYNTH)}
    assert verdicts == {n: n != claim for n in range(1, 9)}
