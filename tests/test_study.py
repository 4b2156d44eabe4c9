"""`normlab study`: the command end to end on the quick grid, its report's numbers against the runs' own, the
measurements against independent references (the no-norm toy's published numbers, float64 norm statistics),
and its one-line errors."""
import json
import math
import re

import pytest
import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer
from training.cli import main as normlab
from training.study import main
from training.study.claims import CLAIMS
from training.study.measure import norm_inputs, outcome, toy_no_norm
from training.study.timing import PAIRS, fused_rms_available, op_ratios


def test_toy_reproduces_the_published_numbers():
    """24 random residual layers (d=512, seed 0): the RMS each layer sees, as printed by the toy's authors."""
    toy = toy_no_norm()
    assert [round(toy[l][0], 1) for l in (1, 6, 12, 24)] == [1.0, 5.6, 45.9, 2738.7]
    assert [round(toy[l][1], 1) for l in (1, 6, 12, 24)] == [1.0] * 4


def _stats64(x: torch.Tensor) -> tuple[float, float]:
    x = x.double()
    mean_over_rms = (x.mean(-1).abs() / x.pow(2).mean(-1).sqrt()).mean().item()
    ln, rms = F.layer_norm(x, x.shape[-1:], eps=1e-5), F.rms_norm(x, x.shape[-1:], eps=1e-5)
    return mean_over_rms, ((ln - rms).norm(dim=-1) / rms.norm(dim=-1)).mean().item()


def test_norm_inputs_against_float64_references():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16))
    with torch.no_grad():
        model.tok_embeddings.weight.add_(0.05)  # a stream with a clear non-zero mean
    tokens = torch.randint(0, 64, (2, 17))
    got = norm_inputs(model, tokens)
    assert set(got) == {"layers.0.attn_res.norm_in", "layers.0.mlp_res.norm_in", "layers.1.attn_res.norm_in",
                        "layers.1.mlp_res.norm_in", "norm"}
    with torch.no_grad():
        embedded = model.tok_embeddings(tokens[:, :-1])
        final_norm, model.norm = model.norm, None
        stream = model.hidden_states(tokens[:, :-1])  # without the final norm: its input
        model.norm = final_norm
    for name, x in (("layers.0.attn_res.norm_in", embedded), ("norm", stream)):
        expected = _stats64(x)
        assert (got[name]["mean_over_rms"], got[name]["ln_vs_rms"]) == pytest.approx(expected, rel=1e-6)
    assert got["layers.0.attn_res.norm_in"]["mean_over_rms"] > 0.5


def test_claim_7_times_like_for_like_pairs_of_the_same_math():
    """Each timed pair computes RMSNorm and LayerNorm (against float64 formulas), the "fused" pair's RMSNorm is
    normlab's fused C++ kernel (its own autograd node, not a composite's), and every pair is timed."""
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 5, 48), torch.rand(48) + 0.5, torch.randn(48)
    x64, w64, b64 = x.double(), w.double(), b.double()
    rms = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w64
    ln = F.layer_norm(x64, (48,), w64, b64, 1e-5)
    for name, (rms_fn, ln_fn) in PAIRS.items():
        assert torch.allclose(rms_fn(x, w, b).double(), rms, atol=1e-5), name
        assert torch.allclose(ln_fn(x, w, b).double(), ln, atol=1e-5), name
    assert fused_rms_available()  # CI has a C++ compiler: the fused pair is measured
    fused = PAIRS["fused"][0](x.requires_grad_(), w, b)
    assert type(fused.grad_fn).__name__ == "_EagerBackward"  # model/kernels/ops.py, not a composite's Mul
    ratios = op_ratios((2, 8, 32), rounds=2, repeats=1)
    assert set(ratios) == set(PAIRS) and all(len(v) == 2 and all(r > 0 for r in v) for v in ratios.values())


@pytest.mark.parametrize("losses, diverged_at, expected", [
    ([7.0] * 5 + [6.0, 5.0, 4.0, 3.0, 2.0], None, "trains"),
    ([7.0, 6.3] + [6.3] * 8, None, "stalled"),  # flat from step 1: no progress after the first 20%
    ([7.0, 6.3] + [6.27] * 8, None, "stalled"),  # 0.03 nats of progress: under the 0.1 bar
    ([7.0, 6.3] + [6.15] * 8, None, "trains"),  # 0.15 nats
    ([7.0, 6.0, 7.5, 8.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.5], None, "diverged"),  # ends above the first loss
    ([7.0, 6.0], 2, "diverged"),  # non-finite
])
def test_outcome(losses, diverged_at, expected):
    assert outcome({"losses": losses, "diverged_at": diverged_at}) == expected


@pytest.mark.parametrize("argv, field", [(["--claims", "13"], "--claims"), (["--claims", "a,b"], "--claims"),
                                         (["--jobs", "0"], "--jobs")])
def test_bad_options_are_one_error_line(capsys, tmp_path, argv, field):
    assert normlab(["study", "--quick", "--output", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("normlab study: error:") and field in err[0]


def _table_rows(report: str) -> dict[str, str]:
    return dict(re.findall(r"^\| (\d+)\. .*? \| \*\*(PASS|FAIL|INCONCLUSIVE)\*\* \|", report, flags=re.M))


@pytest.mark.slow
def test_quick_subset_in_process(tmp_path_factory):
    """`--claims 9,12` runs only those claims' jobs; the toy's numbers and the runs' final losses in the report
    are recomputed here from results.json."""
    out = tmp_path_factory.mktemp("study-subset")
    data = tmp_path_factory.getbasetemp() / "study-data"
    assert main(["--quick", "--claims", "9,12", "--output", str(out), "--data", str(data)]) == 0
    report, results = (out / "report.md").read_text(), json.loads((out / "results.json").read_text())
    assert set(_table_rows(report)) == {"9", "12"}
    assert {c["number"]: c["verdict"] for c in results["claims"]} == {int(k): v for k, v in _table_rows(report).items()}
    assert "layer 24: 2738.7 / 1.0" in report
    assert "9a" in report and "**PASS**" in report.split("| 9a:")[1].split("\n")[0]
    assert {r["label"].split(":")[0] for r in results["runs"]} >= {"profile"}
    for png in ("no_norm.png", "final_norm.png"):
        assert (out / png).stat().st_size > 1000 and f"]({png})" in report
    test_12a = next(c for c in results["claims"] if c["number"] == 12)["tests"][0]
    by_label = {r["label"]: r["seeds"] for r in results["runs"]}
    without = next(v for k, v in by_label.items() if "no-final-norm" in k)
    tail = [sum(s["losses"][-1:]) for s in without]  # 10 steps: the last 10% is the last step
    assert test_12a["a"]["mean"] == pytest.approx(sum(tail) / len(tail))
    assert test_12a["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE")


@pytest.mark.slow
def test_quick_study_every_claim(tmp_path_factory):
    """The CI smoke test: every claim gets a verdict and a section; every claimed plot exists."""
    out = tmp_path_factory.mktemp("study")
    data = tmp_path_factory.getbasetemp() / "study-data"
    assert main(["--quick", "--jobs", "2", "--output", str(out), "--data", str(data)]) == 0
    report = (out / "report.md").read_text()
    assert set(_table_rows(report)) == {str(c.number) for c in CLAIMS}
    for c in CLAIMS:
        assert f"## {c.number}. " in report
    for png in re.findall(r"\]\((\w+\.png)\)", report):
        assert (out / png).stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    assert all(math.isfinite(x) for r in results["runs"] if r["kind"] == "train" and "rmsnorm L2 lr" in r["label"]
               for s in r["seeds"] for x in s["losses"])
