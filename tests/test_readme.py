"""The README as a new user reads it: every command line in its code blocks runs as written (in a scratch
directory that links the repository's `configs/`, with tiny overrides where the real one takes minutes or a
download), its YAML and Python blocks hold, and every relative link in README.md and docs/ resolves.

How each command is checked, when not simply run (`CHECKS` says it per line; a README line missing there fails):
- `pip install ...` needs the network: its extras must exist in pyproject.toml and its torch pin satisfy the
  dependency range.
- `normlab fit` (the default job: minutes): `--print_config` must show the sizes the README states; the same
  command then runs on the tiny corpus for 2 steps, as `runs/default`, for the commands after it — in a process
  where the packages of the extras cannot be imported, so the user's install (`pip install -e .`) is enough.
- `normlab fit --init_from models/qwen3-0.6b ...`: a tiny random Qwen3 stands in for the download (no Hub here).
- `normlab sweep ... --max_parallel 2` (37 minutes): with `--dry_run`; `--report` before any run has finished:
  its one-line answer (the report itself: tests/test_sweep_report.py).
- `tensorboard --logdir runs` (a server): its flags parsed by TensorBoard's own program, and both runs read by its
  event reader.
- `pytest -q` is the suite this test belongs to; it is not started again.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import lightning.pytorch  # noqa: F401  (before capsys: Lightning binds its log handler to stderr at import)
import pytest
import yaml

from tests.helpers.multiproc import REPO, cpu_env
from tests.helpers.published import bpe_tokenizer, hf_model_dir, run_config
from tests.test_data_support import prose_documents
from training.cli import main

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter")

README = REPO / "README.md"
TINY = REPO / "tests" / "helpers" / "tiny.yaml"
TINY_FIT = ["--trainer.max_steps", "2", "--trainer.val_check_interval", "4", "--checkpoint.every_n_steps", "2",
            "--metrics.every_n_steps", "0"]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block of a Markdown text."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def command_lines(text: str) -> dict[str, list[str]]:
    """The command lines of the bash blocks (their words joined by single spaces, comments dropped) → their
    arguments as a shell passes them, in the README's order."""
    split = [shlex.split(line, comments=True) for lang, body in code_blocks(text) if lang == "bash"
             for line in body.splitlines()]
    return {" ".join(args): args for args in split if args}


def normlab(args: list[str], capsys) -> tuple[int, str, str]:
    """`normlab args` in this process: (exit status, stdout, stderr)."""
    try:
        code = main(args)
    except SystemExit as done:  # --print_config ends with jsonargparse's exit
        code = done.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def printed_config(out: str) -> dict:
    """The YAML of `--print_config` (without a DeepSpeed log line that its import writes to this process's stdout)."""
    return yaml.safe_load("\n".join(line for line in out.splitlines() if not line.startswith("[")))


# ---- how each README command line is run -------------------------------------------------------------------

def check_pip(args: list[str], world: dict) -> None:
    from packaging.requirements import Requirement

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    given = [a for a in args[2:] if not a.startswith("-")]
    pins = [Requirement(a) for a in given if not a.startswith(".")]
    extras = [Requirement("normlab" + a.lstrip(".")).extras for a in given if a.startswith(".")]
    torch_range = next(Requirement(d) for d in project["dependencies"] if d.startswith("torch"))
    for pin in pins:
        assert pin.name == "torch" and torch_range.specifier.contains(str(pin.specifier).lstrip("=")), pin
    for extra in set().union(*extras):
        assert extra in project["optional-dependencies"], extra


def check_default_job(args: list[str], world: dict) -> None:
    """`normlab fit`: the sizes the README states, then the same command on the tiny corpus (runs/default)."""
    code, out, err = normlab([*args, "--print_config"], world["capsys"])
    config = printed_config(out)
    stated = re.search(r"\(dim (\d+), (\d+) layers, seq (\d+), batch (\d+), vocab (\d+)\) for (\d+) steps",
                       README.read_text().replace("\n", " "))
    assert code == 0 and stated, (out + err)[-1500:]
    dim, layers, seq, batch, vocab, steps = map(int, stated.groups())
    assert (config["model"]["dim"], config["model"]["n_layers"], config["data"]["seq_len"],
            config["data"]["batch_size"], config["trainer"]["max_steps"]) == (dim, layers, seq, batch, steps)
    from data.prepare import DEFAULT_VOCAB_SIZE

    assert DEFAULT_VOCAB_SIZE == vocab
    given = ["fit", "-c", str(TINY), "--data.path", str(world["tiny"]), *args[1:], *TINY_FIT]
    proc = subprocess.run([sys.executable, "-c", WITHOUT_EXTRAS, *given], capture_output=True, text=True,
                          timeout=300, env=cpu_env())
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]


# The top-level packages only the extras bring ([test], [eval], [loggers]): the user's install has none of them.
EXTRAS_ONLY = ("pytest", "triton", "ruff", "wandb", "mlflow", "lm_eval", "accelerate", "peft")
# None in sys.modules makes `import` fail and `importlib.util.find_spec` answer None, as for an absent package.
WITHOUT_EXTRAS = f"""
import sys
sys.modules.update(dict.fromkeys({EXTRAS_ONLY!r}))
from training.cli import main
sys.exit(main(sys.argv[1:]))
"""


def run_tiny_fit(args: list[str], world: dict, config: Path = TINY, data: str | None = None) -> None:
    """`args` (normlab fit ...) with `-c config` first (the README's own flags override it) and a tiny run."""
    given = args[1:]
    data_args = [] if "--data.path" in given else ["--data.path", data or str(world["tiny"])]
    code, _, err = normlab(["fit", "-c", str(config), *data_args, *given, *TINY_FIT], world["capsys"])
    assert code == 0, err[-2000:]


def check_published(args: list[str], world: dict) -> None:
    """`--init_from models/qwen3-0.6b`: the tiny Qwen3 directory made at that path."""
    code, _, err = normlab(["fit", "-c", str(world["short_run"]), *args[1:]], world["capsys"])
    assert code == 0, err[-2000:]
    name = args[args.index("--name") + 1]
    assert (Path("runs") / name / "checkpoints" / "step-00000001" / "manifest.json").is_file()


def run_as_written(args: list[str], world: dict) -> None:
    code, out, err = normlab(args, world["capsys"])
    assert code == 0, (out + err)[-2000:]


def check_compare(args: list[str], world: dict) -> None:
    run_as_written(args, world)
    assert Path(args[args.index("--plot") + 1]).stat().st_size > 0


def check_sweep(args: list[str], world: dict) -> None:
    if "--report" in args:
        code, _, err = normlab(args, world["capsys"])
        line = err.strip().splitlines()[-1]
        assert code == 2 and "nothing to report yet" in line, err
        return
    extra = [] if {"--dry_run", "--status"} & set(args) else ["--dry_run"]
    code, out, err = normlab([*args, *extra], world["capsys"])
    assert code == 0 and "pending" in out, (out + err)[-2000:]


def check_tensorboard(args: list[str], world: dict) -> None:
    from tensorboard import program
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    program.TensorBoard().configure(argv=args)  # raises on a flag TensorBoard does not know
    logdir = args[args.index("--logdir") + 1]
    runs = EventMultiplexer().AddRunsFromDirectory(logdir).Reload()
    for run in ("default", "post"):
        assert "train/loss" in runs.Runs()[run]["scalars"], run


def check_ruff(args: list[str], world: dict) -> None:
    if not (Path(sys.executable).parent / "ruff").exists():
        pytest.skip("ruff is not installed here (the [test] extra has it)")
    proc = subprocess.run([str(Path(sys.executable).parent / "ruff"), *args[1:]], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]


def check_pytest(args: list[str], world: dict) -> None:
    assert tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"] \
        == ["tests"]


CHECKS = {  # the README's command lines, in its order, and how each is checked
    "pip install torch==2.13.0 -e .": check_pip,
    "normlab fit": check_default_job,
    "normlab fit --model.placement post --name post": run_tiny_fit,
    "normlab compare runs/default runs/post --plot compare.png": check_compare,
    "tensorboard --logdir runs": check_tensorboard,
    "normlab sweep configs/sweeps/placement_lr_cpu.yaml --dry_run": check_sweep,
    "normlab sweep configs/sweeps/placement_lr_cpu.yaml --max_parallel 2": check_sweep,
    "normlab sweep configs/sweeps/placement_lr_cpu.yaml --status": check_sweep,
    "normlab sweep configs/sweeps/placement_lr_cpu.yaml --report": check_sweep,
    "normlab prepare --input ~/corpus --output data/qwen3 --tokenizer models/qwen3-0.6b/tokenizer.json":
        run_as_written,
    "normlab fit --init_from models/qwen3-0.6b --data.path data/qwen3 --name qwen3-cpt": check_published,
    "normlab fit --init_from models/qwen3-0.6b --data.path data/qwen3 --name qwen3-dyt --model.norm dyt":
        check_published,
    "pip install torch==2.13.0 -e .[test,eval]": check_pip,
    "ruff check .": check_ruff,
    "pytest -q": check_pytest,
}


@pytest.fixture
def scratch(workdir, tmp_path, monkeypatch, capsys) -> dict:
    """A new user's checkout: the repository's configs, a home with a corpus in ~/corpus, a tiny Qwen3 download
    in models/qwen3-0.6b; the current directory is there."""
    home = tmp_path / "home"
    (home / "corpus").mkdir(parents=True)
    texts = prose_documents(40)
    (home / "corpus" / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    hf_model_dir(tmp_path / "models" / "qwen3-0.6b", "qwen3", bpe_tokenizer(tmp_path / "bpe", texts))
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NORMLAB_DEBUG", raising=False)
    return {"tiny": workdir / "tiny", "capsys": capsys, "short_run": run_config(tmp_path / "short.yaml")}


def test_every_readme_command_runs_as_written(scratch):
    lines = command_lines(README.read_text())
    assert sorted(lines) == sorted(CHECKS), "a README command line without a check here (or one gone)"
    for line, args in lines.items():  # in the README's order: later commands use what earlier ones made
        args = [os.path.expanduser(a) for a in args]
        CHECKS[line](args[1:] if args[0] == "normlab" else args, scratch)  # normlab's main takes the command on


def test_the_readme_yaml_is_an_abridged_copy_of_its_spec():
    lang, body = next(b for b in code_blocks(README.read_text()) if b[0] == "yaml")
    path = re.match(r"# (\S+\.yaml)", body).group(1)
    shown, real = yaml.safe_load(body), yaml.safe_load((REPO / path).read_text())

    def within(a, b, where: str) -> None:
        if isinstance(a, dict):
            for key, value in a.items():
                assert isinstance(b, dict) and key in b, f"{where}.{key} is not in {path}"
                within(value, b[key], f"{where}.{key}")
        else:
            assert a == b, f"{where}: README {a!r}, {path} {b!r}"

    within(shown, real, "spec")


def test_the_readme_python_block_runs():
    import torch

    lang, body = next(b for b in code_blocks(README.read_text()) if b[0] == "python")
    scope: dict = {}
    exec(compile(body, "README.md", "exec"), scope)  # noqa: S102  the README's own example
    tokens = torch.randint(0, 8192, (2, 64))
    with torch.no_grad():
        assert scope["logits"].shape == (2, 64, 8192)
        diff = (scope["model"](tokens) - scope["hf_model"](tokens).logits).abs().max().item()
    assert diff <= 1e-4


def test_the_wrong_loggers_form_says_the_right_one(tmp_path, capsys, monkeypatch):
    """`--loggers wandb mlflow` (several words) is one line naming the form that works."""
    monkeypatch.delenv("NORMLAB_DEBUG", raising=False)
    code, out, err = normlab(["fit", "--loggers", "wandb", "mlflow", "--print_config"], capsys)
    assert code == 2 and out == ""
    assert err.strip().splitlines()[-1] == ('normlab fit: error: --loggers wandb mlflow: give the list as one value: '
                                            '--loggers "[wandb, mlflow]" (or loggers: [wandb, mlflow] in a -c file)')
    code, out, _ = normlab(["fit", "--loggers", "[wandb, mlflow]", "--print_config"], capsys)
    assert code == 0 and printed_config(out)["loggers"] == ["wandb", "mlflow"]


def test_the_readme_inline_fit_flags_parse(tmp_path, capsys, monkeypatch):
    """A `fit` flag with a value quoted inline in the text (`--loggers "[wandb, mlflow]"`, `--ckpt_path last`)
    parses as written; placeholders (`N`, `a|b`, `<name>`) are left out."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("NORMLAB_DEBUG", raising=False)
    _, help_text, _ = normlab(["fit", "--help"], capsys)
    flags = set(re.findall(r"--[\w.]+", help_text))
    spans = re.findall(r"`(--[\w.]+) ([^`]+)`", README.read_text())
    checked = [(flag, value) for flag, value in spans if flag in flags and not re.search(r"[|<>…]|^[A-Z]+$", value)]
    assert ("--loggers", '"[csv, wandb, mlflow]"') in checked
    for flag, value in dict.fromkeys(checked):
        code, out, err = normlab(["fit", flag, *shlex.split(value), "--print_config"], capsys)
        assert code == 0, f"README's `{flag} {value}`: {err.strip().splitlines()[-1:]}"


# ---- links -------------------------------------------------------------------------------------------------

PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page: lower case, punctuation dropped, spaces as hyphens."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
        for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif fragment and file.suffix == ".md" and fragment not in anchors(file):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken


def test_every_docs_page_named_in_configs_and_docs_exists():
    """Pages named in plain text (a YAML comment, a sentence), as `docs/<page>.md`, relative to the repository."""
    sources = [*PAGES, *sorted((REPO / "configs").rglob("*.yaml"))]
    missing = sorted({f"{src.relative_to(REPO)}: {name}" for src in sources
                      for name in re.findall(r"(?<![\w/.])docs/[\w./-]*\w\.md", src.read_text())
                      if not (REPO / name).is_file()})
    assert not missing, missing


def readme_tree(root: str) -> set[str]:
    """The paths the README's architecture tree lists under `root/` (`root/pkg/module.py`; a line naming several
    modules, `a.py, b.py`, lists each; a package shown whole, as `sweep/`, is listed as its directory)."""
    block = next(body for lang, body in code_blocks(README.read_text()) if body.startswith(f"{root}/\n"))
    paths, stack = set(), []
    for line in block.splitlines()[1:]:
        names = re.match(r"^( +)([^\s,]+(?:, [^\s,]+\.py)*)", line)
        if not names:
            continue
        depth = len(names.group(1)) // 2 - 1
        stack[depth:] = []
        for name in names.group(2).split(", "):
            paths.add("/".join([root, *stack, name.rstrip("/")]))
        if names.group(2).endswith("/"):
            stack.append(names.group(2).rstrip("/"))
    return paths


def test_every_training_module_is_in_the_readme_tree():
    """The file tree is the architecture: every module of training/ has its line (sweep/ and study/, the two
    applications, one line each)."""
    listed = readme_tree("training")
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "training").rglob("*.py") if p.name != "__init__.py"}
    summarized = {m for m in modules if m.split("/")[1] in ("sweep", "study")}
    assert sorted(modules - summarized - listed) == []
    assert sorted(p for p in listed if p.endswith(".py") and p not in modules) == []  # no line for a module gone
    assert {"training/sweep", "training/study"} <= listed
