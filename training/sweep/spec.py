"""The sweep spec (a YAML file) and its expansion into runs: cells (grid × zip) × seeds.

    name: placement_lr            # default: the spec file's stem; the runs go to <runs_dir>/<name>/
    runs_dir: runs                # relative to the current directory, as for `normlab fit`
    base:                         # what every run shares, exactly as `normlab fit` takes it
      config: [configs/gpu_125m.yaml]             # -c files (relative to the current directory)
      overrides: {trainer.max_steps: 2000}         # dotted keys → values (--key=value)
    grid: {model.placement: [pre, post], optim.lr: [1.0e-3, 3.0e-3]}   # crossed
    zip: {optim.lr: [...], optim.min_lr: [...]}   # axes that vary together (equal lengths), crossed with grid
    seeds: [0, 1, 2]              # each run's --seed_everything (the initialization)
    data_order: seed              # seed (default): --data.seed=<seed> per run; fixed: one data order for all runs
    metric: val/loss              # what the report judges ({tag: TAG, reduce: final | min | max | {mean_last: K}}),
                                  # and `mode` (min | max) says which way is better
    outcomes: {spikes: {window: 50, threshold: 6, margin: 1}}   # stability outcomes judged too (outcomes.py)
    baseline: placement=pre       # a cell name (or null); margin: the equivalence margin of the report
    question: cells               # what the verdicts answer: cells | lr_sensitivity | best_lr
    compare: [placement=post]     # the question's family: the cells (or LR groups) judged against the baseline
    executor: {slurm: {...}}      # each executor's own settings, under its name (slurm: training/sweep/slurm.py);
                                  # a top-level `slurm: {...}`, as older specs give it, is read the same

Both data orders are paired: the cells' runs at one seed share the initialization and (`seed`) their batch
order, so the report's differences are taken seed by seed; `seed` also lets the data order vary between
replicates, as the study does. The question's family is what Holm's correction runs across: the cells listed
in `compare` against the baseline (`question: cells`), or the LR groups listed there against the baseline's
group (`lr_sensitivity`, `best_lr`); without `compare`, every other cell or group.

A cell's name is `short=value,...` over the axes in spec order, the short name being the key's last component
(the full key when two axes share it): `placement=post,lr=0.003`. A run is one cell × one seed:
`<runs_dir>/<name>/<cell>/s<seed>/`, trained by `python -m training.cli fit ... --ckpt_path=last`, which starts
it or resumes it from its newest complete checkpoint.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from training import safe_yaml
from training.errors import UserError
from training.run.membership import format_value
from training.stats import MODES, Reduction
from training.sweep.outcomes import parse_metric, parse_outcomes

SPEC_KEYS = ("name", "runs_dir", "base", "grid", "zip", "seeds", "data_order", "metric", "mode", "baseline",
             "margin", "lr_key", "question", "compare", "outcomes", "executor", "slurm")
LEGACY_EXECUTOR_KEYS = ("slurm",)  # executors whose settings older specs give as a top-level key
DATA_ORDERS = ("seed", "fixed")
QUESTIONS = ("cells", "lr_sensitivity", "best_lr")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
# Keys the runner sets itself on every run.
RESERVED = ("name", "runs_dir", "ckpt_path", "seed_everything", "trainer.default_root_dir")


@dataclass(frozen=True, kw_only=True)
class Run:
    """One cell × seed: its directory relative to the sweep's, and its `fit` arguments."""

    cell: str
    params: dict[str, Any]
    seed: int
    rel: str                 # <cell>/s<seed>, relative to the sweep directory
    fit_args: list[str]      # everything after `python -m training.cli fit`

    @property
    def command(self) -> list[str]:
        return ["python", "-m", "training.cli", "fit", *self.fit_args]


@dataclass(frozen=True, kw_only=True)
class Spec:
    path: Path
    name: str
    runs_dir: Path
    configs: tuple[str, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    zip: dict[str, list[Any]] = field(default_factory=dict)
    seeds: tuple[int, ...] = (0,)
    data_order: str = "seed"
    metric: str = "val/loss"
    reduce: Reduction = field(default_factory=Reduction)
    mode: str = "min"
    baseline: str | None = None
    margin: float | None = None
    lr_key: str | None = None
    question: str = "cells"
    compare: tuple[str, ...] | None = None
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)  # outcome name → its settings
    executor: dict[str, dict[str, Any]] = field(default_factory=dict)  # executor name → its settings

    @property
    def slurm(self) -> dict[str, Any]:
        """The Slurm executor's settings (training/sweep/slurm.py)."""
        return self.executor.get("slurm", {})

    @property
    def sweep_dir(self) -> Path:
        return self.runs_dir / self.name

    @property
    def axes(self) -> list[str]:
        return [*self.grid, *self.zip]

    def cells(self) -> list[tuple[str, dict[str, Any]]]:
        """(name, params) of every cell: the grid's product crossed with the zipped rows, in spec order."""
        grid = [dict(zip(self.grid, values, strict=True)) for values in itertools.product(*self.grid.values())]
        n_zip = len(next(iter(self.zip.values()))) if self.zip else 1
        zipped = [{k: v[i] for k, v in self.zip.items()} for i in range(n_zip)]
        cells = [{**g, **z} for g in grid for z in zipped]
        shorts = short_names(self.axes)
        return [(",".join(f"{shorts[k]}={format_value(c[k])}" for k in self.axes) or "base", c) for c in cells]

    def lr_group(self, cell: str) -> str:
        """The LR group of a cell: its name without the LR axis (and the axes zipped with it)."""
        drop = {self.lr_key} | (set(self.zip) if self.lr_key in self.zip else set())
        return ",".join(p for p, axis in zip(cell.split(","), self.axes, strict=True) if axis not in drop) or "all"

    def lr_groups(self) -> list[str]:
        return list(dict.fromkeys(self.lr_group(cell) for cell, _ in self.cells()))

    def runs(self) -> list[Run]:
        runs = []
        for cell, params in self.cells():
            for seed in self.seeds:
                rel = f"{cell}/s{seed}"
                runs.append(Run(cell=cell, params=params, seed=seed, rel=rel, fit_args=self.fit_args(params, seed,
                                                                                                    cell)))
        return runs

    def fit_args(self, params: dict[str, Any], seed: int, cell: str) -> list[str]:
        args = [a for c in self.configs for a in ("-c", c)]
        args += [f"--{k}={format_value(v)}" for k, v in {**self.overrides, **params}.items()]
        if self.data_order == "seed":
            args.append(f"--data.seed={seed}")
        args += [f"--seed_everything={seed}", f"--runs_dir={self.sweep_dir / cell}", f"--name=s{seed}",
                 "--ckpt_path=last"]
        return args


def short_names(keys: list[str]) -> dict[str, str]:
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: s if last.count(s) == 1 else k for k, s in zip(keys, last, strict=True)}


def _same_value(value: Any) -> Any:
    """What two values that configure the same run share: numbers by value (1 and 1.0), the rest as written."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return format_value(value)


def _fail(path: Path, what: str) -> UserError:
    return UserError(f"sweep spec '{path}': {what}")


def _mapping(path: Path, raw: Any, field_: str, scalar_values: bool) -> dict[str, list[Any]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _fail(path, f"{field_} must be a mapping of dotted config keys to lists of values, got {raw!r}")
    for key, values in raw.items():
        if not isinstance(key, str) or not _KEY.match(key) or key in RESERVED:
            raise _fail(path, f"{field_} key {key!r} is not a dotted config key such as optim.lr"
                        + (f" (the runner sets {key} itself)" if key in RESERVED else ""))
        if not isinstance(values, list) or not values:
            raise _fail(path, f"{field_}.{key} must be a non-empty list of values, got {values!r}")
        for v in values if scalar_values else ():
            if not isinstance(v, (str, int, float, bool)) and v is not None or "/" in str(v) or "," in str(v):
                raise _fail(path, f"{field_}.{key} value {v!r} must be a number, a word, true/false or null "
                            "(without '/' or ',': it becomes part of a directory name)")
        if field_ == "grid" and len(set(map(_same_value, values))) != len(values):  # (1 and 1.0: the same run)
            raise _fail(path, f"{field_}.{key} lists a value twice: {values!r}")
    return dict(raw)


def _base(path: Path, raw: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    raw = raw or {}
    if not isinstance(raw, dict) or set(raw) - {"config", "overrides"}:
        raise _fail(path, f"base must be a mapping with 'config' (list of -c files) and 'overrides', got {raw!r}")
    configs = raw.get("config") or []
    configs = [configs] if isinstance(configs, str) else configs
    if not isinstance(configs, list) or not all(isinstance(c, str) for c in configs):
        raise _fail(path, f"base.config must be a list of config files, got {configs!r}")
    for c in configs:
        if not Path(c).is_file():
            raise _fail(path, f"base.config file '{c}' does not exist (paths are relative to the current "
                        f"directory, {Path.cwd()})")
    overrides = raw.get("overrides") or {}
    if not isinstance(overrides, dict):
        raise _fail(path, f"base.overrides must be a mapping of dotted keys to values, got {overrides!r}")
    for key in overrides:
        if not isinstance(key, str) or not _KEY.match(key) or key in RESERVED:
            raise _fail(path, f"base.overrides key {key!r} is not a dotted config key"
                        + (f" (the runner sets {key} itself)" if key in RESERVED else ""))
    return tuple(configs), dict(overrides)


def load_spec(path: str | Path) -> Spec:
    """Parse and validate a spec file; every problem is one UserError naming the file, field and value."""
    path = Path(path)
    try:
        raw = safe_yaml.load(path.read_text(), f"sweep spec '{path}'")
    except OSError as err:
        raise UserError(f"sweep spec '{path}' cannot be read: {err.strerror}") from err
    except UnicodeDecodeError as err:
        raise _fail(path, f"not a UTF-8 text file (byte {err.start}); give a YAML sweep spec") from None
    except yaml.YAMLError as err:
        raise _fail(path, f"not valid YAML ({' '.join(str(err).split())})") from err
    if not isinstance(raw, dict):
        raise _fail(path, "must be a YAML mapping (keys: " + ", ".join(SPEC_KEYS) + ")")
    unknown = sorted(set(raw) - set(SPEC_KEYS))
    if unknown:
        raise _fail(path, f"unknown key {unknown[0]!r}; valid keys: {', '.join(SPEC_KEYS)}")
    name = str(raw.get("name") or path.stem)
    if not _NAME.match(name):
        raise _fail(path, f"name {name!r} must be letters, digits and _.+- (it is a directory name)")
    configs, overrides = _base(path, raw.get("base"))
    grid = _mapping(path, raw.get("grid"), "grid", True)
    zipped = _mapping(path, raw.get("zip"), "zip", True)
    if len({len(v) for v in zipped.values()}) > 1:
        raise _fail(path, f"zip axes must have equal lengths, got { {k: len(v) for k, v in zipped.items()} }")
    rows = list(zip(*([_same_value(x) for x in v] for v in zipped.values()), strict=True))
    twice = next((i for i, row in enumerate(rows) if row in rows[:i]), None)
    if twice is not None:  # an axis may repeat a value (arms that differ in another key), a whole row may not
        raise _fail(path, f"zip lists row {twice + 1} twice: {({k: v[twice] for k, v in zipped.items()})!r}")
    both = sorted(set(grid) & set(zipped) | (set(grid) | set(zipped)) & set(overrides))
    if both:
        raise _fail(path, f"{both[0]!r} is set twice (grid, zip and base.overrides must not share keys)")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise _fail(path, f"seeds must be a list of distinct non-negative integers, got {seeds!r}")
    try:
        (metric, reduce), outcomes = parse_metric(raw.get("metric")), parse_outcomes(raw.get("outcomes"))
    except ValueError as err:
        raise _fail(path, str(err)) from None
    spec = Spec(path=path, name=name, runs_dir=Path(raw.get("runs_dir") or "runs").absolute(), configs=configs,
                overrides=overrides, grid=grid, zip=zipped, seeds=tuple(seeds),
                data_order=_data_order(path, raw), metric=metric, reduce=reduce, outcomes=outcomes,
                mode=_choice(path, raw, "mode", MODES, "min"),
                baseline=raw.get("baseline"), margin=_margin(path, raw.get("margin")),
                lr_key=raw.get("lr_key", "optim.lr" if "optim.lr" in grid or "optim.lr" in zipped else None),
                question=_choice(path, raw, "question", QUESTIONS, "cells"), compare=_names(path, raw.get("compare")),
                executor=_executor_settings(path, raw))
    cells = [c for c, _ in spec.cells()]
    if spec.baseline is not None and spec.baseline not in cells:
        raise _fail(path, f"baseline {spec.baseline!r} is not a cell; the cells are: {', '.join(cells)}")
    if spec.lr_key is not None and spec.lr_key not in spec.axes:
        raise _fail(path, f"lr_key {spec.lr_key!r} is not an axis of grid or zip ({', '.join(spec.axes)})")
    _check_question(spec, cells)
    return spec


def _data_order(path: Path, raw: dict) -> str:
    if raw.get("data_order") == "paired":
        raise _fail(path, "data_order 'paired' is now called 'fixed' (one data order for every run); the default, "
                    "'seed', varies the data order with the seed and is paired too")
    return _choice(path, raw, "data_order", DATA_ORDERS, "seed")


def _names(path: Path, raw: Any) -> tuple[str, ...] | None:
    if raw is None:
        return None
    if not isinstance(raw, list) or not raw or not all(isinstance(x, str) for x in raw) or len(set(raw)) < len(raw):
        raise _fail(path, f"compare must be a non-empty list of distinct cell (or LR group) names, got {raw!r}")
    return tuple(raw)


def _check_question(spec: Spec, cells: list[str]) -> None:
    """The question's family must name what exists: cells, or LR groups (which need an lr_key)."""
    if (spec.question != "cells" or "lr_reach" in spec.outcomes) and spec.lr_key is None:
        what = f"question {spec.question!r}" if spec.question != "cells" else "outcomes.lr_reach"
        raise _fail(spec.path, f"{what} compares LR groups: give an lr_key (an axis of grid or zip)")
    if spec.compare is None:
        return
    if spec.baseline is None:
        raise _fail(spec.path, "compare lists what is judged against the baseline: give a baseline too")
    valid = cells if spec.question == "cells" else spec.lr_groups()
    own = spec.baseline if spec.question == "cells" else spec.lr_group(spec.baseline)
    what = "cell" if spec.question == "cells" else "LR group"
    for name in spec.compare:
        if name not in valid or name == own:
            raise _fail(spec.path, f"compare entry {name!r} is not a {what} other than the baseline's; choose "
                        f"from: {', '.join(v for v in valid if v != own)}")


def _executor_settings(path: Path, raw: dict) -> dict[str, dict[str, Any]]:
    """`executor: {NAME: {...}}`, with a top-level `slurm: {...}` (the older spelling) read as `executor.slurm`.
    Which names are executors, and which keys each takes, the executors check (executors.py, slurm.py)."""
    settings = raw.get("executor") or {}
    if not isinstance(settings, dict) or not all(isinstance(v, dict) or v is None for v in settings.values()):
        raise _fail(path, f"executor must map an executor's name to its settings, e.g. {{slurm: {{nodes: 2}}}}, got "
                    f"{settings!r}")
    settings = {name: dict(values or {}) for name, values in settings.items()}
    for name in LEGACY_EXECUTOR_KEYS:
        if raw.get(name) is None:
            continue
        if name in settings:
            raise _fail(path, f"{name} settings are given twice, as `{name}:` and as `executor: {{{name}: ...}}`; keep "
                        "one")
        if not isinstance(raw[name], dict):
            raise _fail(path, f"{name} must be a mapping of the {name} executor's settings, got {raw[name]!r}")
        settings[name] = dict(raw[name])
    return settings


def _choice(path: Path, raw: dict, key: str, valid: tuple[str, ...], default: str) -> str:
    value = raw.get(key, default)
    if value not in valid:
        raise _fail(path, f"{key} {value!r} is not one of {list(valid)}")
    return value


def _margin(path: Path, value: Any) -> float | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
        raise _fail(path, f"margin {value!r} must be a non-negative number (in the metric's units) or null")
    return None if value is None else float(value)
