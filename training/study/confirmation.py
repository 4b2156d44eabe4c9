"""The study's scorecard of record: each claim's exploratory verdict beside its confirmatory one, and the horizon
check.

- **Exploratory**: a committed study run (seeds 0–5 trained, 0–9 at init), judged again from its CSVs with the
  current claims (`judge_csv`). A primary whose test was fixed after that run's data had been seen
  (`training.study.claims.SPECIFIED_AFTER`) is "specified after" there: its exploratory verdict shows what the
  data said, not a test.
- **Confirmatory**: `normlab study --seed_start 1000 --primaries_only` runs of the claims, on seeds disjoint from
  every seed a test was specified on. A claim's verdict is its confirmatory one wherever it has one.
- **Horizon**: the same confirmatory run with every trained run twice as long (`--horizon 2`, same seeds). A claim
  whose verdict differs between the two horizons is "horizon-dependent": at this scale its answer depends on how
  long the models train.

Each run directory's `results.json` (written by `normlab study`) is read as it is; nothing is recomputed from
runs here except the exploratory CSVs.
"""
from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

from training.errors import UserError
from training.study.claims import BY_NUMBER, CLAIMS, Claim, Test, specified
from training.study.grid import SCALES, Train
from training.study.judge import Outcome, bh_scorecard, combine, from_samples, judge_tests, mark_plateau, measure
from training.study.measure import UNIGRAM_ENTROPY
from training.study.scorecard import low_power
from training.study.statistics import Context

RUN_STATS = ("final_loss", "best_lr_loss", "lr_sensitivity", "loss_gap", "diverged_runs", "lr_reach",
             "high_lr_sensitivity")
HORIZON_DEPENDENT = "horizon-dependent"


def _float(text: str) -> float:
    return float(text) if text else math.nan


def runs_results(path: Path, entropy: float = math.inf) -> dict[str, list[dict]]:
    """Per configuration label of a study's runs.csv, its runs in seed order as the study's statistics read them.
    runs.csv holds no unigram entropy: give the study corpus's (`data.entropy.unigram_entropy`) for the plateau
    rule, or leave it +inf to keep the outcome the study recorded: a run runs.csv marks 'plateau' gets its own
    held-out loss as the entropy (so the plateau rule reads it as on the plateau), every other run +inf."""
    out: dict[str, dict[int, dict]] = {}
    for row in csv.DictReader(path.open()):
        loss = _float(row["held_out_loss"])
        recorded = loss if row["outcome"] == "plateau" and not math.isfinite(entropy) else entropy
        out.setdefault(row["configuration"], {})[int(row["seed"])] = {
            "val_loss": loss, "losses": [_float(row["initial_loss"])],
            "diverged_at": 0 if row["outcome"] == "diverged" else None, "probes": {}, UNIGRAM_ENTROPY: recorded}
    return {label: [runs[s] for s in sorted(runs)] for label, runs in out.items()}


def measurements(path: Path) -> dict[str, tuple[str, str, str, list[float], list[float] | None]]:
    """Per test id of a study's measurements.csv: (statistic, role a, role b, per-seed a, per-seed b or None)."""
    out: dict[str, tuple] = {}
    for row in csv.DictReader(path.open()):
        stat, a, b, samples_a, samples_b = out.setdefault(row["test"], (row["statistic"], row["role_a"],
                                                                        row["role_b"], [], []))
        samples_a.append(float(row["value_a"]))
        if row["value_b"]:
            samples_b.append(float(row["value_b"]))
    return {k: (s, a, b, xs, ys or None) for k, (s, a, b, xs, ys) in out.items()}


def csv_outcome(test: Test, ctx: Context, csv_values: dict) -> Outcome | None:
    """A test measured from a study's CSVs: statistics of held-out losses from runs.csv (through the study's own
    statistics), others from measurements.csv when the test's statistic and roles are unchanged; None when the
    run did not make what the test reads."""
    if test.stat in RUN_STATS:
        try:
            return measure(ctx, test)
        except (KeyError, IndexError):  # a role whose runs the study did not make
            return None
    if test.id in csv_values:
        stat, a, b, xs, ys = csv_values[test.id]
        if (stat, a, b or None) == (test.stat, test.a, test.b):
            return from_samples(test, xs, ys)
    return None


def judged_primaries(claim: Claim, runs: dict, csv_values: dict) -> tuple[Context, list[Outcome | None]]:
    """A claim's primaries measured from a study's runs (by label) and CSV values, and judged each alone; None
    for a primary that reads a run the study did not make."""
    scale = SCALES["default"]
    roles = claim.setup(scale)
    results = {spec: runs[spec.label()] for spec in roles.values() if isinstance(spec, Train) and spec.label() in runs}
    ctx = Context(scale, roles, results)
    outs = [csv_outcome(t, ctx, csv_values) for t in claim.primaries]
    judge_tests([o for o in outs if o is not None])
    return ctx, outs


def judge_csv(study: Path, entropy: float = math.inf) -> dict[int, tuple[str, list[tuple[Test, Outcome | None]]]]:
    """Per claim, the verdict of its current primaries on a committed study's CSVs (AWAITS when a primary reads
    runs the study did not make; AT PLATEAU as `judge_all` gives it, with the corpus's unigram `entropy`), and
    each primary's outcome."""
    runs, csv_values = runs_results(study / "runs.csv", entropy), measurements(study / "measurements.csv")
    rows, judged = [], []
    for claim in CLAIMS:
        ctx, outs = judged_primaries(claim, runs, csv_values)
        judged += [o for o in outs if o is not None and o.judgement is not None]
        rows.append((claim, ctx, outs))
    bh_scorecard(judged)
    out = {}
    for claim, ctx, outs in rows:
        ready = [o for o in outs if o is not None]
        mark_plateau(ctx, ready)
        verdict = AWAITS if len(ready) < len(outs) else combine([o.verdict for o in ready])
        out[claim.number] = (verdict, list(zip(claim.primaries, outs, strict=True)))
    return out


AWAITS = "awaits a run"


def read_run(path: Path) -> dict[int, dict]:
    """Per claim of a `normlab study` run directory: its verdict, primary tests (as results.json has them), and
    the run's seeds and horizon."""
    file = path / "results.json"
    try:
        doc = json.loads(file.read_text())
        header = doc["header"]
        claims = doc["claims"]
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"{file}: not a study's results.json ({type(e).__name__}); give a `normlab study` output "
                        "directory") from None
    start = int(header.get("seed_start", 0))
    out = {}
    for c in claims:
        primaries = {t["id"]: t for t in c["tests"] if t["tier"] == "primary"}
        n = max((t["a"]["n"] for t in primaries.values() if t.get("a")), default=0)
        out[c["number"]] = {"verdict": c["verdict"], "tests": primaries, "seeds": range(start, start + n),
                            "horizon": int(header.get("horizon", 1)), "dir": path.name}
    return out


def _estimate(test: dict) -> str:
    """A primary's estimate as results.json has it: the paired difference a − b (or one role's statistic)."""
    e = test.get("diff") if test.get("b") else test.get("a")
    if not e or not math.isfinite(e["mean"]):
        return "—"
    shift = test.get("threshold", 0.0) if test.get("b") else 0.0  # the judged difference is a − b − threshold
    return f"{e['mean'] + shift:.3g} [{e['lo'] + shift:.3g}, {e['hi'] + shift:.3g}]"


def _seeds(r: range) -> str:
    return f"seeds {r.start}–{r.stop - 1}" if len(r) else "—"


def committed_verdicts(study: Path) -> dict[int, str]:
    """Per claim, the verdict the committed report.md printed (its section headings)."""
    heading = re.compile(r"^## (\d+)\. .* — \*\*([\w ]+)\*\*$", flags=re.M)
    return {int(n): v for n, v in heading.findall((study / "report.md").read_text())}


def horizon_label(one: str | None, two: str | None) -> str:
    """"horizon-dependent" when a claim's verdict differs between the two horizons; "" when it holds (or was not
    checked)."""
    return HORIZON_DEPENDENT if one and two and one != two else ""


def specified_text(test: Test, seeds: range) -> str:
    """"specified after" when the test was fixed after data on some of these seeds had been seen."""
    return f"specified {specified(test.id, seeds)}"


EXPLORATORY_SEEDS = range(0, 10)  # the committed run: seeds 0–5 trained, 0–9 at init


def scorecard(exploratory: Path, confirms: list[Path], horizon: list[Path], entropy: float = math.inf) -> list[str]:
    """The scorecard of record as Markdown lines: per claim, exploratory and confirmatory verdicts side by side,
    the horizon check, and the claim's verdict (the confirmatory one where it exists)."""
    explo, committed = judge_csv(exploratory, entropy), committed_verdicts(exploratory)
    conf = {n: run for path in confirms for n, run in read_run(path).items()}
    hor = {n: run for path in horizon for n, run in read_run(path).items()}
    lines = ["| claim | evidence of | tokens per parameter | committed report | primary | exploratory (seeds 0–5; "
             "init 0–9), judged now: verdict, estimate; specified | confirmatory: verdict, estimate; seeds | "
             "horizon ×2 (same seeds) | **verdict of record** |", "|---|---|---|---|---|---|---|---|---|"]
    for claim in CLAIMS:
        lines += _claim_rows(claim.number, explo[claim.number], committed.get(claim.number, "—"),
                             conf.get(claim.number), hor.get(claim.number))
    return lines


def verdict_of_record(exploratory: str, outs: list, confirmatory: dict | None) -> str:
    """The confirmatory verdict where the claim was confirmed; else the exploratory one, marked "unconfirmed"
    when a primary was specified after the exploratory data."""
    if confirmatory is not None:
        return confirmatory["verdict"]
    after = any(specified(t.id, EXPLORATORY_SEEDS) == "after" for t, _ in outs)
    return f"{exploratory} (unconfirmed)" if after else exploratory


def tokens_per_parameter(number: int, horizon: int = 1) -> str:
    """The training tokens per model parameter of the runs a claim's primaries read (steps × batch × sequence over
    the model's parameter count, embeddings included), as a range over those runs; "at init" for a claim whose
    primaries train nothing; "no training" for one timed in the main process."""
    import torch

    from model import Transformer
    from training.study.claims import select, used_roles

    scale = SCALES["default"].longer(horizon)
    claim = select([number], primaries_only=True)[0]
    ratios = set()
    try:
        roles = used_roles(claim, claim.setup(scale))
    except ValueError:  # a role measured in the main process (the timing claims' untrained models)
        return "no training"
    for spec in roles.values():
        if isinstance(spec, Train):
            with torch.device("meta"):
                params = sum(p.numel() for p in Transformer(spec.arch.config(scale, scale.vocab_size)).parameters())
            ratios.add(spec.steps * scale.batch_size * scale.seq_len / params)
    if not ratios:
        return "at init"
    lo, hi = min(ratios), max(ratios)
    return f"{lo:.2g}" if f"{lo:.2g}" == f"{hi:.2g}" else f"{lo:.2g}–{hi:.2g}"


def _claim_rows(number: int, explo: tuple, committed: str, c: dict | None, h: dict | None) -> list[str]:
    verdict, outs = explo
    claim = BY_NUMBER[number]
    record = verdict_of_record(verdict, outs, c)
    label = horizon_label(c["verdict"] if c else None, h["verdict"] if h else None)
    record = f"**{record}**" + (f" ({label}: ×2 gives {h['verdict']})" if label else "")
    powers = [c["tests"][t.id].get("power") for t, _ in outs if t.id in c["tests"]] if c is not None else \
        [o.power for _, o in outs if o is not None]  # of the tests the verdict of record comes from
    if any(low_power(x) for x in powers):
        record += f" ({UNINFORMATIVE_MARK})"
    tpp = tokens_per_parameter(number)  # once per claim: it builds the models (on the meta device)
    if tpp != "at init" and h is not None:
        tpp += f" (×2: {tokens_per_parameter(number, 2)})"
    rows = []
    for i, (test, o) in enumerate(outs):
        e_text = ("—" if o is None else f"{o.verdict}{_mark(o.power)}, {_ci(o)}") + \
            f"; {specified_text(test, EXPLORATORY_SEEDS)}"
        c_text = h_text = "—"
        if c is not None and test.id in c["tests"]:
            ct = c["tests"][test.id]
            c_text = f"{ct['verdict']}{_mark(ct.get('power'))}, {_estimate(ct)}; {_seeds(c['seeds'])}"
        if h is not None and test.id in h["tests"]:
            ht = h["tests"][test.id]
            h_text = f"{ht['verdict']}{_mark(ht.get('power'))}, {_estimate(ht)}"
        head = (f"{number}. {claim.title}", claim.evidence, tpp, committed, record) if i == 0 else ("",) * 5
        rows.append(f"| {head[0]} | {head[1]} | {head[2]} | {head[3]} | {test.id} | {e_text} | {c_text} | {h_text} "
                    f"| {head[4]} |")
    return rows


UNINFORMATIVE_MARK = "uninformative"


def _mark(power: float | None) -> str:
    """" (uninformative)" after a verdict whose test had under 50% power at its margin."""
    return f" ({UNINFORMATIVE_MARK})" if low_power(power) else ""


def _ci(o: Outcome) -> str:
    e = o.shown  # the raw paired difference a − b, or one arm's statistic
    return f"{e.mean:.3g} [{e.lo:.3g}, {e.hi:.3g}]" if math.isfinite(e.mean) else "—"


def runs_table(paths: list[Path]) -> list[str]:
    """One line per run directory: its command, seeds, horizon, code and claims hash, wall time and load."""
    lines = ["| run | command | code (commit) | claims sha256 at the start | wall time | load before → after |",
             "|---|---|---|---|---|---|"]
    for path in paths:
        header = json.loads((path / "results.json").read_text())["header"]
        lines.append(f"| {path.name} | `{header.get('command', '?')}` | {str(header.get('commit', '?'))[:12]} | "
                     f"{str(header.get('claims_sha256', 'not recorded'))[:16]} | {header.get('minutes', 0):.1f} min "
                     f"({header.get('jobs', '?')} jobs) | {header.get('load_before', '?')} → "
                     f"{header.get('load_after', '?')} |")
    return lines


def write_scorecard(out: Path, exploratory: Path, confirms: list[Path], horizon: list[Path],
                    entropy: float = math.inf) -> None:
    """Write the scorecard of record (Markdown) to `out`, atomically."""
    from data.atomic import write_text_atomic
    from training.study.provenance import claims_sha256

    text = ["# The normalization study: the scorecard of record", "", SCORECARD_INTRO, "",
            f"Judged with the claims whose sha256 is `{claims_sha256()}`; unigram entropy of the study corpus "
            f"{entropy:.4f} nats (the plateau).", "", *scorecard(exploratory, confirms, horizon, entropy), "",
            "## Runs", "", *runs_table([*confirms, *horizon]), ""]
    write_text_atomic(out, "\n".join(text))


SCORECARD_INTRO = (
    "Each claim's primary tests, judged three times: on the **exploratory** run (the committed `report.md`, seeds "
    "0–5 trained and 0–9 at init, judged again from its CSVs with the current claims and rules), on a "
    "**confirmatory** run on fresh seeds (1000 onwards, disjoint from every seed a test was specified on), and, "
    "for the claims whose answer is about leaving the unigram plateau, at **twice the steps** on the same "
    "confirmatory seeds. 'specified after' marks a primary whose test was fixed after the exploratory data had "
    "been seen: its exploratory verdict is what the data said, not a test. The **verdict of record** is the "
    "confirmatory one where a claim was confirmed, else the exploratory one (every primary specified before its "
    "data); a verdict that differs between the two horizons is marked **horizon-dependent**. AT PLATEAU: an arm "
    "of the test ends on the unigram plateau (≥ 80% of its seeds within 0.05 nats of the corpus's unigram "
    "entropy): the statistic measures the plateau, not the claim. Estimates are paired differences a − b (or one "
    "arm's statistic) with 95% t-intervals; the confirmatory runs' own reports give every p, q, power and seed. "
    "'uninformative': the test had under 50% power at its margin (a PASS there may exaggerate the effect). Tokens "
    "per parameter: those of the runs the claim's primaries train (steps × batch × sequence over the model's "
    "parameters).")
