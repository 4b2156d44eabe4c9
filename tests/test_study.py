"""`normlab study`: the command end to end on the quick grid, its report's numbers against the runs' own, the
measurements against independent references (the no-norm toy's published numbers, float64 norm statistics),
and its one-line errors."""
import csv
import json
import math
import os
import re
import statistics

import numpy as np
import pytest
import scipy.stats as scipy_stats
import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer
from training.cli import main as normlab
from training.study import main, timing
from training.study.claims import CLAIMS
from training.study.cli import load_measurements
from training.study.grid import SCALES, shallow
from training.study.measure import (
    INPUT_SCALES,
    block_ablation,
    dim_spread,
    final_loss,
    input_scaling,
    norm_inputs,
    outcome,
    toy_no_norm,
    val_loss,
)
from training.study.timing import (
    NORM_BACKWARD_NODES,
    PAIRS,
    fused_rms_available,
    norm_time_ratios,
    op_ratios,
    step_time_ratios,
)


def test_toy_reproduces_the_published_numbers():
    """24 random residual layers (d=512, seed 0): the RMS each layer sees, as printed by the toy's authors."""
    toy = toy_no_norm()
    assert [round(toy[l][0], 1) for l in (1, 6, 12, 24)] == [1.0, 5.6, 45.9, 2738.7]
    assert [round(toy[l][1], 1) for l in (1, 6, 12, 24)] == [1.0] * 4


def _stats64(x: torch.Tensor) -> tuple[float, float, float]:
    x = x.double()
    mean, ms = x.mean(-1), x.pow(2).mean(-1)
    mean_over_rms = (mean.abs() / ms.sqrt()).mean().item()
    isotropy = (x.shape[-1] * mean.pow(2).mean() / ms.mean()).item()
    ln, rms = F.layer_norm(x, x.shape[-1:], eps=1e-5), F.rms_norm(x, x.shape[-1:], eps=1e-5)
    return mean_over_rms, isotropy, ((ln - rms).norm(dim=-1) / rms.norm(dim=-1)).mean().item()


def _model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=3, n_heads=2, max_seq_len=16))


def test_norm_inputs_against_float64_references():
    model = _model()
    with torch.no_grad():
        model.tok_embeddings.weight.add_(0.05)  # a stream with a clear non-zero mean
    tokens = torch.randint(0, 64, (2, 17))
    got = norm_inputs(model, tokens)
    assert set(got) == {f"layers.{i}.{s}_res.norm_in" for i in range(3) for s in ("attn", "mlp")} | {"norm"}
    with torch.no_grad():
        embedded = model.tok_embeddings(tokens[:, :-1])
        final_norm, model.norm = model.norm, None
        stream = model.hidden_states(tokens[:, :-1])  # without the final norm: its input
        model.norm = final_norm
    for name, x in (("layers.0.attn_res.norm_in", embedded), ("norm", stream)):
        expected = _stats64(x)
        assert (got[name]["mean_over_rms"], got[name]["isotropy"], got[name]["ln_vs_rms"]) == pytest.approx(
            expected, rel=1e-6)
    assert got["layers.0.attn_res.norm_in"]["isotropy"] > 10  # the shared offset, far above isotropic noise
    noise = torch.randn(4096, 64, dtype=torch.float64)
    assert _stats64(noise)[1] == pytest.approx(1.0, abs=0.1)  # the statistic's null value is 1 at any width


def _manual_loss(model: Transformer, tokens: torch.Tensor, skip: int | None = None, scale_at: int | None = None,
                 k: float = 1.0) -> float:
    """The model's loss with its blocks run by hand: block `skip` left out, or the stream entering block
    `scale_at` multiplied by k."""
    from model.residual import Stream
    from model.rope import rope_cos_sin

    x, y = tokens[:, :-1], tokens[:, 1:]
    cos, sin = rope_cos_sin(x.shape[1], model.cfg.head_dim, model.cfg.rope_theta, x.device)
    stream = Stream(model.tok_embeddings(x))
    for i, layer in enumerate(model.layers):
        if i == scale_at:
            stream = Stream(stream.value() * k)
        if i != skip:
            stream = layer(stream, cos, sin, None, None)
    h = stream.normalized(model.norm)[0]
    return F.cross_entropy((h @ model.output.weight.T).flatten(0, 1), y.flatten()).item()


def test_block_ablation_input_scaling_and_dimension_spread_against_a_hand_run_forward():
    model = _model()
    val = [torch.randint(0, 64, (2, 17)) for _ in range(2)]
    with torch.no_grad():
        ablated = block_ablation(model, val)
        scaled = input_scaling(model, val)
        for l in range(3):
            assert ablated[l] == pytest.approx(statistics.fmean(_manual_loss(model, t, skip=l) for t in val), rel=1e-5)
        for k in INPUT_SCALES:
            assert scaled[k] == pytest.approx(statistics.fmean(_manual_loss(model, t, scale_at=1, k=k) for t in val),
                                              rel=1e-5)
        assert val_loss(model, val) == pytest.approx(statistics.fmean(_manual_loss(model, t) for t in val), rel=1e-5)
        final_norm, model.norm = model.norm, None
        stream = model.hidden_states(val[0][:, :-1]).double().reshape(-1, 32)
        model.norm = final_norm
    per_dim = stream.pow(2).mean(0).sqrt()
    assert dim_spread(model, val[0]) == pytest.approx(math.log(per_dim.max() / per_dim.median()), rel=1e-6)


def test_claim_21_times_like_for_like_pairs_of_the_same_math(monkeypatch):
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
    node = fused.grad_fn.name()  # model/kernels/cpu_rms.cpp's autograd function, not a composite's Mul ...
    assert "RMSNormFunction" in node and any(n in node for n in NORM_BACKWARD_NODES), node  # ... that norm time counts
    ratios = op_ratios((2, 8, 32), rounds=2, repeats=1, runs=1)  # one median per timing run
    assert set(ratios) == set(PAIRS) and all(len(v) == 1 and all(r > 0 for r in v) for v in ratios.values())
    scale = SCALES["quick"]
    step = step_time_ratios(shallow(scale, qk_norm="head"), shallow(scale), scale, 64, torch.randint(0, 64, (2, 9)),
                            rounds=2, steps=1, runs=1)
    assert len(step) == 1 and all(r > 0 for r in step)
    # the in-step norm time (claims 21a/b): one median ratio per timing run, and a share for every judged round;
    # which model is profiled first changes from round to round (round_orders), not always RMSNorm's
    profiled, step_of = [], timing._NormProfile.step
    monkeypatch.setattr(timing._NormProfile, "step", lambda self: profiled.append(self.arch.norm) or step_of(self))
    times, shares = norm_time_ratios(shallow(scale, bias=True), scale, 64, torch.randint(0, 64, (2, 9)), rounds=2,
                                     runs=1)
    assert len(times) == 1 and all(r > 0 for r in times)
    assert {k: len(v) for k, v in shares.items()} == {"rmsnorm": 2, "layernorm": 2}
    assert all(0 < s < 1 for v in shares.values() for s in v)
    firsts = profiled[::2]  # per round (a warm-up and two judged rounds), the model profiled first
    assert len(profiled) == 6 and {"rmsnorm", "layernorm"} == set(firsts[1:])


@pytest.mark.parametrize("losses, diverged_at, expected", [
    ([7.0] * 5 + [6.0, 5.0, 4.0, 3.0, 2.0], None, "trains"),
    ([7.0, 6.3] + [6.3] * 8, None, "plateau"),  # ends at the unigram entropy (6.3 here)
    ([7.0, 6.3] + [6.27] * 8, None, "plateau"),  # 0.03 nats below it: within PLATEAU_NATS
    ([7.0, 6.3] + [6.15] * 8, None, "trains"),  # 0.15 nats below it
    ([7.0, 6.1, 6.2, 6.3, 6.2, 6.15] + [6.1] * 4, None, "trains"),  # no progress after its warm-up dip, yet 0.2 below
    ([7.0, 6.0, 7.5, 8.0, 9.0, 9.0, 9.0, 9.0, 9.0, 9.5], None, "diverged"),  # ends above the first loss
    ([7.0, 6.0], 2, "diverged"),  # non-finite
])
def test_outcome(losses, diverged_at, expected):
    assert outcome({"losses": losses, "diverged_at": diverged_at, "unigram_entropy": 6.3}) == expected


def test_a_finite_runaway_held_out_loss_is_a_divergence():
    """A run that trained but whose held-out loss ends above its first training loss diverged: its loss is an
    outcome (inf), not a number to average."""
    run = {"losses": [7.0] * 5 + [6.0, 5.0, 4.0, 3.0, 2.0], "diverged_at": None, "val_loss": 9.7e6,
           "unigram_entropy": 6.3}
    assert outcome(run) == "diverged" and final_loss(run) == math.inf
    assert final_loss(run | {"val_loss": 2.5}) == 2.5


@pytest.mark.parametrize("argv, field", [(["--claims", "23"], "--claims"), (["--claims", "a,b"], "--claims"),
                                         (["--jobs", "0"], "--jobs"), (["--seeds", "1"], "--seeds"),
                                         (["--rejudge"], "--rejudge")])
def test_bad_options_are_one_error_line(capsys, tmp_path, argv, field):
    assert normlab(["study", "--quick", "--output", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("normlab study: error:") and field in err[0]


def test_rejudge_never_runs_code_from_a_measurements_file(capsys, tmp_path):
    """`--rejudge` reads measurements.pt weights-only: a crafted pickle that would run a command is refused with
    one line, and the command does not run."""
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"scale": Evil(), "results": {}, "extra": {}, "header": {}}, tmp_path / "measurements.pt")
    assert normlab(["study", "--rejudge", "--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "measurements.pt" in err[0] and not marker.exists()


def _table_rows(report: str) -> dict[str, str]:
    verdicts = "PASS|FAIL|INCONCLUSIVE|EQUIVALENT|AT PLATEAU"
    return dict(re.findall(rf"^\| (\d+)\. .*? \| \*\*({verdicts})\*\*(?: [†‡])* \|", report, flags=re.M))


@pytest.mark.slow
def test_quick_subset_in_process(tmp_path_factory):
    """`--claims 9,12` runs only those claims' jobs. The report's paired estimate of 12a is recomputed from
    runs.csv with scipy; measurements.csv holds the per-seed values behind it; `--rejudge` rebuilds the same
    report from the saved measurements without training."""
    out = tmp_path_factory.mktemp("study-subset")
    data = tmp_path_factory.getbasetemp() / "study-data"
    assert main(["--quick", "--claims", "9,12", "--output", str(out), "--data", str(data)]) == 0
    report, results = (out / "report.md").read_text(), json.loads((out / "results.json").read_text())
    assert set(_table_rows(report)) == {"9", "12"}
    assert {c["number"]: c["verdict"] for c in results["claims"]} == {int(k): v for k, v in _table_rows(report).items()}
    assert "layer 24: 2738.7 / 1.0" in report
    assert "**PASS**" in report.split("| 9d:")[1].split("\n")[0]  # the toy, a mechanism check
    for png in ("no_norm.png", "final_norm.png"):
        assert (out / png).stat().st_size > 1000 and f"]({png})" in report
    runs = list(csv.DictReader((out / "runs.csv").open()))
    deep = [r for r in runs if r["configuration"].startswith("pre-rmsnorm L4 lr")]
    deep_nf = [r for r in runs if r["configuration"].startswith("pre-rmsnorm L4 no-final-norm")]
    a = [float(r["held_out_loss"]) for r in sorted(deep_nf, key=lambda r: int(r["seed"]))]
    b = [float(r["held_out_loss"]) for r in sorted(deep, key=lambda r: int(r["seed"]))]
    test_12a = next(c for c in results["claims"] if c["number"] == 12)["tests"][0]
    ref = scipy_stats.ttest_rel(a, b)
    assert test_12a["diff"]["mean"] == pytest.approx(statistics.fmean(a) - statistics.fmean(b), rel=1e-9)
    assert (test_12a["diff"]["lo"], test_12a["diff"]["hi"]) == pytest.approx(tuple(ref.confidence_interval()), rel=1e-6)
    rows = [r for r in csv.DictReader((out / "measurements.csv").open()) if r["test"] == "12a"]
    assert [float(r["value_a"]) for r in rows] == pytest.approx(a) and [float(r["value_b"]) for r in rows] == b
    # the plateau every trained run was judged against: the train split's unigram entropy (float64), on record
    meta = json.loads((data / "meta.json").read_text())
    counts = np.bincount(np.fromfile(data / meta["splits"]["train"]["file"], dtype=meta["dtype"]))
    p = counts[counts > 0] / counts.sum()
    doc = load_measurements(out / "measurements.pt")
    assert doc["extra"]["unigram_entropy"] == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-9)
    before = report
    (out / "report.md").unlink()
    assert main(["--rejudge", "--output", str(out)]) == 0
    assert (out / "report.md").read_text() == before


@pytest.mark.slow
def test_quick_study_every_claim(tmp_path_factory):
    """The CI smoke test: every claim gets a verdict and a section; every claimed plot exists; the summary table
    comes first and every primary has a margin."""
    out = tmp_path_factory.mktemp("study")
    data = tmp_path_factory.getbasetemp() / "study-data"
    assert main(["--quick", "--jobs", "2", "--output", str(out), "--data", str(data)]) == 0
    report = (out / "report.md").read_text()
    assert set(_table_rows(report)) == {str(c.number) for c in CLAIMS}
    assert report.index("## Summary") < report.index("## Setup") < report.index("## 1. ")
    for c in CLAIMS:
        assert f"## {c.number}. " in report
    for png in re.findall(r"\]\((\w+\.png)\)", report):
        assert (out / png).stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())
    primaries = [t for c in results["claims"] for t in c["tests"] if t["tier"] == "primary"]
    assert len(primaries) == sum(len(c.primaries) for c in CLAIMS)
    assert all(t["margin"] or t["threshold"] for t in primaries)
    assert all(math.isfinite(x) for r in results["runs"] if r["kind"] == "train" and "rmsnorm L2 lr" in r["label"]
               for s in r["seeds"] for x in s["losses"])
