"""normlab never runs a model's own code: every command that reads a Hugging Face directory refuses one whose
`config.json` has an `auto_map` (and `prepare` a tokenizer whose `tokenizer_config.json` has one) in one line,
exit status 2, before `transformers` could stop at its "Do you wish to run the custom code? [y/N]" prompt.
The custom code here would leave a marker file if it ever ran."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import lightning.pytorch  # noqa: F401  (before capsys: Lightning binds its log handler to stderr at import)
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from tests.helpers.multiproc import cpu_env  # noqa: E402
from tests.helpers.published import bpe_tokenizer, fit_args, hf_model_dir, prepared_data, run_config  # noqa: E402
from tests.helpers.tasks import TASK, write_task  # noqa: E402
from tests.test_data_support import prose_documents  # noqa: E402
from training.cli import main  # noqa: E402

PROMPT = "Do you wish to run the custom code"
CUSTOM_CODE = "from pathlib import Path\nPath({marker!r}).write_text('ran')\n"


def with_custom_code(source: Path, out: Path, marker: Path, model_type: str) -> Path:
    """A copy of the model directory `source` whose config.json names custom classes in Python files beside it
    (as a Hub model with `trust_remote_code` does); importing either file writes `marker`."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    config.update(model_type=model_type, auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                                   "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"})
    (out / "config.json").write_text(json.dumps(config))
    for name in ("configuration_custom.py", "modeling_custom.py"):
        (out / name).write_text(CUSTOM_CODE.format(marker=str(marker)))
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("remote-code")
    texts = prose_documents(40)
    tok = bpe_tokenizer(root / "bpe", texts)
    plain = hf_model_dir(root / "plain", "llama3", tok)
    marker = root / "RAN"
    custom_tok = shutil.copytree(tok.parent, root / "custom-tokenizer")
    (custom_tok / "tokenizer_config.json").write_text(json.dumps(
        {"auto_map": {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizerFast"]}}))
    (custom_tok / "tokenization_custom.py").write_text(CUSTOM_CODE.format(marker=str(marker)))
    return {"root": root, "data": prepared_data(root, tok, texts), "config": run_config(root / "run.yaml"),
            "marker": marker, "custom": with_custom_code(plain, root / "custom", marker, "normlab_custom"),
            # a known model_type: transformers would not ask, and would run its own Llama instead of the custom code
            "custom_llama": with_custom_code(plain, root / "custom-llama", marker, "llama"),
            "custom_tokenizer": custom_tok, "tasks": write_task(Path(tmp_path_factory.mktemp("tasks")))}


def refused(argv: list[str], capsys) -> str:
    """Run `normlab argv` here; it must fail with exit status 2 and one error line, print nothing on stdout (the
    prompt goes there) and never ask. Returns the error line."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and PROMPT not in err and "Traceback" not in err, (code, out, err)
    return err.strip().splitlines()[-1]


def test_fit_init_from_with_stdin_closed_is_refused_without_asking(world, tmp_path):
    """What a sweep or a batch job sees: a real process with nothing on stdin."""
    args = fit_args(world["config"], world["data"], tmp_path / "runs", "custom", "--init_from", str(world["custom"]))
    proc = subprocess.run([sys.executable, "-m", "training.cli", *args], cwd=world["root"], env=cpu_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and PROMPT not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert lines[-1].startswith("normlab fit: error: --init_from") and "auto_map" in lines[-1]
    assert "configuration_custom.CustomConfig" in lines[-1] and "never runs" in lines[-1]
    assert not world["marker"].exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("source", ["custom", "custom_llama"])
def test_fit_init_from_refuses_custom_code_even_for_a_known_model_type(source, world, tmp_path, capsys):
    line = refused(fit_args(world["config"], world["data"], tmp_path / "runs", "c", "--init_from",
                            str(world[source])), capsys)
    assert f"--init_from {world[source]}: its config.json has an auto_map" in line
    assert not world["marker"].exists() and not (tmp_path / "runs").exists()


COMMANDS = {  # every other command that reads a Hugging Face directory: {dir}, {data}, {tasks}, {out} filled in
    "generate": "generate --checkpoint {dir} --prompt hello --device cpu",
    "evaluate": "evaluate --checkpoint {dir} --data {data} --device cpu --output {out}/e.json",
    "evaluate_tasks": f"evaluate --checkpoint {{dir}} --tasks {TASK} --include_path {{tasks}} --device cpu "
                      "--output {out}/t.json",
    "export": "export --checkpoint {dir} --output {out}/export",
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_commands_reading_a_model_directory_refuse_custom_code(command, world, tmp_path, capsys):
    out = tmp_path / "out"
    argv = COMMANDS[command].format(dir=world["custom"], data=world["data"], tasks=world["tasks"], out=out).split()
    line = refused(argv, capsys)
    assert line.startswith(f"normlab {argv[0]}: error: '{world['custom']}': its config.json has an auto_map"), line
    assert not world["marker"].exists() and not out.exists()


def test_prepare_refuses_a_tokenizer_defined_by_custom_code(world, tmp_path, capsys):
    out = tmp_path / "data"
    line = refused(["prepare", "--input", str(world["root"] / "docs.jsonl"), "--tokenizer",
                    str(world["custom_tokenizer"]), "--output", str(out)], capsys)
    assert "tokenizer_config.json' has an auto_map" in line and "tokenization_custom" in line
    assert not world["marker"].exists() and not out.exists()
