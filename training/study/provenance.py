"""Where a study's numbers come from: the git commit of the code that ran and a hash of the claims it was judged
with, and the seeds it used. A reader of a report (or of one row of measurements.csv) can then tell which code
measured it and whether the tests it was judged by are the committed ones, without trusting prose.

The claims' hash covers what decides a verdict: every claim's number and every test's judging fields (id,
statistic, roles, kind, threshold, margin, tier, tolerance, params), serialized as JSON with sorted keys. Wording
(titles, test texts) and evidence labels are how a verdict is read, not how it is reached: relabelling a claim
after a run does not change the hash. The setup functions are code, not data: they are left out (their effect is
in the commit)."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from training.study import claims as claims_module
from training.study.claims import Claim

REPO = Path(__file__).resolve().parents[2]


WORDING = ("text",)  # test fields that word a test and do not judge it


def claims_data(claims: Sequence[Claim]) -> list[dict]:
    """The claims as plain data: what the hash covers."""
    return [{"number": c.number, "tests": [{k: v for k, v in dataclasses.asdict(t).items() if k not in WORDING}
                                           for t in c.tests]} for c in claims]


def claims_sha256(claims: Sequence[Claim] | None = None) -> str:
    """sha256 of the canonical JSON serialization of `claims` (sorted keys, no whitespace); by default the
    claims the study judges with (`claims.CLAIMS`, read at the call)."""
    claims = claims_module.CLAIMS if claims is None else claims
    text = json.dumps(claims_data(claims), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()


def git_commit() -> str:
    """`git rev-parse HEAD` of the repository, with "+dirty" when its tree has uncommitted changes; "unknown"
    when the code does not run from a git checkout (or git is missing)."""
    try:
        commit = _git("rev-parse", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "") if commit else "unknown"


def run_seeds(scale) -> range:
    """The seeds a run of this scale uses: `seed_start` onwards, as many as its largest per-job count (trained
    runs use the first `seeds` of them, at-init measurements the first `init_seeds`)."""
    start = getattr(scale, "seed_start", 0)
    return range(start, start + max(scale.seeds, scale.init_seeds))


def provenance(scale) -> dict:
    """The run header's provenance entries: commit, claims hash and seeds (first, last)."""
    seeds = run_seeds(scale)
    return {"commit": git_commit(), "claims_sha256": claims_sha256(), "seeds": [seeds.start, seeds.stop - 1]}


def header_seeds(header: dict, scale) -> range:
    """The seeds a run recorded in its header; a run from before seeds were recorded used its scale's."""
    if "seeds" in header:
        first, last = header["seeds"]
        return range(first, last + 1)
    return run_seeds(scale)
