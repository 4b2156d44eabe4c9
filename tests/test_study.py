"""`normlab study --quick`: the report has every claim, and its numbers are the runs' own."""
import json
import math
import re

import pytest

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
