"""The confirmatory study: fresh seeds, primaries-only runs, the horizon check and the scorecard of record."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from training.errors import UserError
from training.study.claims import BY_NUMBER, SPECIFIED_AFTER, select, specified, used_roles
from training.study.confirmation import HORIZON_DEPENDENT, horizon_label, read_run
from training.study.grid import SCALES
from training.study.runner import claim_jobs, roles_of


def test_a_confirmatory_run_takes_seeds_disjoint_from_those_its_tests_were_specified_on():
    scale = replace(SCALES["default"], seeds=6, seed_start=1000)
    seeds = {seed for _, seed in claim_jobs(select([4, 5, 15], primaries_only=True), scale)}
    assert min(seeds) == 1000 and max(seeds) == 1009  # 6 trained, 10 at init
    for test_id, seen in SPECIFIED_AFTER.items():
        assert not seeds & set(seen)
        assert specified(test_id, range(1000, 1010)) == "before"
        assert specified(test_id, range(0, 6)) == "after"
    plain = {seed for _, seed in claim_jobs(select([4]), SCALES["default"])}
    assert plain == set(range(6))


def test_primaries_only_runs_the_roles_its_primaries_read():
    scale = SCALES["default"]
    roles = roles_of(select([4, 7, 16], primaries_only=True), scale)
    # 4f: the interaction at the lowest LR reads its two roles and their pre-LN twins (the swap)
    assert sorted(roles[4]) == ["post-w0@0", "post-w1@0", "pre-w0@0", "pre-w1@0"]
    assert sorted(roles[7]) == ["layernorm", "rmsnorm"]
    assert len(roles[16]) == 2 * len(scale.high_post_lrs)  # a family name reads its whole LR grid
    assert len(roles_of(select([4]), scale)[4]) > 4  # the full claim keeps every run
    claim = select([4], primaries_only=True)[0]
    broken = replace(claim, tests=(replace(claim.tests[0], a="post-w9@0"),))
    with pytest.raises(ValueError, match="post-w9@0"):
        used_roles(broken, BY_NUMBER[4].setup(scale))
    assert all(t.tier == "primary" for c in select(None, primaries_only=True) for t in c.tests)


def test_a_longer_horizon_scales_every_trained_run_and_keeps_the_warm_up_fraction():
    scale = SCALES["default"]
    two = scale.longer(2)
    assert (two.steps, two.deep_steps, two.long_steps) == (400, 300, 2000)
    jobs = {spec for spec, _ in claim_jobs(select([4], primaries_only=True), replace(two, seed_start=1000))}
    assert {j.steps for j in jobs} == {400} and {j.warmup for j in jobs} == {0.0, scale.warmup}


def test_a_verdict_that_flips_with_the_horizon_is_labelled():
    assert horizon_label("PASS", "FAIL") == HORIZON_DEPENDENT
    assert horizon_label("INCONCLUSIVE", "PASS") == HORIZON_DEPENDENT
    assert horizon_label("PASS", "PASS") == ""
    assert horizon_label("PASS", None) == ""


@pytest.mark.parametrize("power", [0.33, 0.9])
def test_a_confirmatory_verdict_under_half_power_is_marked_uninformative(power):
    """The scorecard of record carries the report's marker: a PASS at 33% power may exaggerate its effect."""
    from training.study.confirmation import _claim_rows

    test = BY_NUMBER[6].primaries[0]
    stat = {"n": 6, "mean": 0.2, "lo": 0.1, "hi": 0.3}
    confirm = {"verdict": "PASS", "seeds": range(1000, 1006), "horizon": 1,
               "tests": {test.id: {"verdict": "PASS", "power": power, "a": stat, "b": stat, "diff": stat}}}
    row = _claim_rows(6, ("INCONCLUSIVE", [(test, None)]), "PASS", confirm, None)[0]
    record = row.rstrip(" |").rsplit("| ", 1)[1]
    assert ("uninformative" in record) == (power < 0.5), record
    assert ("PASS (uninformative), 0.2 [0.1, 0.3]" in row) == (power < 0.5), row


def test_tokens_per_parameter_are_those_of_the_runs_the_primaries_train():
    """Claim 1's primary reads the long deep run: its tokens over the parameters of a model built for real."""
    from model import Transformer
    from training.study.confirmation import tokens_per_parameter
    from training.study.grid import long_run

    scale = SCALES["default"]
    run = long_run(scale)
    params = sum(p.numel() for p in Transformer(run.arch.config(scale, scale.vocab_size)).parameters())
    ratio = scale.long_steps * scale.batch_size * scale.seq_len / params
    assert tokens_per_parameter(1) == f"{ratio:.2g}" and tokens_per_parameter(1, horizon=2) == f"{2 * ratio:.2g}"
    assert tokens_per_parameter(5) == "at init" and tokens_per_parameter(21) == "no training"


def test_read_run_refuses_a_directory_without_results(tmp_path):
    with pytest.raises(UserError, match="results.json"):
        read_run(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"header": {"seed_start": 1000, "horizon": 2}, "claims": [
        {"number": 4, "verdict": "PASS", "tests": [
            {"id": "4f", "tier": "primary", "verdict": "PASS", "a": {"n": 6}, "b": {"n": 6}, "threshold": 0.0,
             "diff": {"mean": 0.1, "lo": 0.05, "hi": 0.15}}]}]}))
    run = read_run(tmp_path)[4]
    assert run["seeds"] == range(1000, 1006) and run["horizon"] == 2 and run["verdict"] == "PASS"


def test_a_primaries_only_confirmatory_run_writes_its_report(tmp_path):
    """At-init claims only (seconds): a confirmatory run end to end, its report and CSVs on seeds 1000+."""
    import csv as csv_module

    from training.study.cli import run_study

    verdicts = run_study(tmp_path / "out", quick=True, claims=[5, 13], jobs=1, data_dir=tmp_path / "data",
                         seed_start=1000, primaries_only=True)
    assert [c.number for c, _ in verdicts] == [5, 13]
    report = (tmp_path / "out" / "report.md").read_text()
    # 5b is a secondary: no row of it (a bare "5b" can occur in the commit's hex digest in the header)
    assert "--seed_start 1000 --primaries_only" in report and "| 5b:" not in report
    rows = list(csv_module.DictReader((tmp_path / "out" / "measurements.csv").open()))
    assert {int(r["seed"]) for r in rows} == set(range(1000, 1000 + SCALES["quick"].init_seeds))
    assert {r["test"] for r in rows} == {"5a", "13a", "13b"}
    assert {r["specified"] for r in rows} == {"before"}  # 13b was specified after seeds 0-9, not these
    run = read_run(tmp_path / "out")
    assert run[13]["seeds"].start == 1000


def _claims_at(commit: str):
    """CLAIMS as claims.py defined them at `commit` (its source from git, executed against today's modules)."""
    import subprocess
    import sys
    import types
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    try:
        source = subprocess.run(["git", "show", f"{commit}:training/study/claims.py"], cwd=repo, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"git history with commit {commit} is not available in this checkout")
    module = types.ModuleType("claims_at_commit")
    sys.modules[module.__name__] = module  # dataclasses resolve their module by name
    try:
        exec(compile(source, f"{commit}:claims.py", "exec"), module.__dict__)  # noqa: S102 - our own history
    finally:
        del sys.modules[module.__name__]
    return module.CLAIMS


def test_the_claims_hash_at_the_confirmatory_runs_commit_is_the_one_they_are_judged_with():
    """Pre-registration, checked: the tests (statistics, roles, kinds, margins) the committed confirmatory runs
    are judged with are those in claims.py at the commit the runs recorded, a commit older than their data."""
    from pathlib import Path

    from training.study.provenance import claims_sha256

    v5 = Path(__file__).resolve().parents[1] / "docs" / "study" / "v5"
    headers = [json.loads((d / "results.json").read_text())["header"] for d in sorted(v5.iterdir()) if d.is_dir()]
    assert len(headers) >= 4 and all(h["seed_start"] >= 1000 for h in headers)
    commits = {h["commit"] for h in headers}
    assert all(not c.endswith("+dirty") for c in commits), commits  # the code that ran is a commit
    scorecard = (v5.parent / "scorecard.md").read_text()
    for commit in commits:
        assert claims_sha256(_claims_at(commit)) == claims_sha256() and claims_sha256() in scorecard
