"""The `normlab` command.

    normlab prepare ...                       build a tokenizer + token files (data.prepare)
    normlab fit | validate | test [options]   LightningCLI: YAML configs (-c), dotted overrides, --print_config
    normlab evaluate | export | generate | study     plain commands (see COMMANDS)

`normlab fit` with no arguments is the default job: it prepares the default corpus if needed and trains a
small (~7.4M parameter) Llama-style model, fp32 on CPU (bf16-mixed on a GPU), logging to `runs/default/`.

Run layout: `--runs_dir`/`--name` (default `runs/default`) holds the TensorBoard events, `config.yaml` and
`checkpoints/step-XXXXXXXX/` (layout: training/run/layout.py; saving: training/checkpointing/save.py),
and `spikes/step-XXXXXXXX/` with `--guard.dump_spike_z` (training/callbacks/spikes.py).
`--ckpt_path last` resumes the newest complete checkpoint — or starts fresh when there is none, so one command
both starts and resumes a job. `--branch_from` starts a new run from another run's checkpoint
(training/checkpointing/branch.py).
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from training.cluster import signals
from training.console import quiet_third_party, setup_logging
from training.errors import UserError, is_user_error, report_user_error
from training.subcommands import LIGHTNING_SUBCOMMANDS

# Plain commands: name → ("module:function", one-line help). The function takes the remaining argv and returns
# an exit code; it is imported only when run, so `normlab prepare` does not pay for importing Lightning.
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare": ("data.prepare:main", "build a tokenizer and token files from text (default: the built-in corpus)"),
    "evaluate": ("training.eval.cli:main", "loss/ppl/bpb of checkpoints or whole runs, or harness tasks"),
    "export": ("training.export:main", "a checkpoint as a Hugging Face directory"),
    "generate": ("training.generate:main", "continue a prompt with a saved checkpoint"),
    "compare": ("training.compare:main", "a table of config differences and final metrics of runs, and a loss plot"),
    "study": ("training.study:main", "the normalization study: claims tested over seeds, plots and a report"),
    "sweep": ("training.sweep.cli:main", "a grid of fit runs x seeds, locally or on Slurm: resumable, with a report"),
    "coordcheck": ("training.coordcheck:main", "μP's coordinate check: activation RMS against width, with slopes"),
}


def usage() -> str:
    lines = [f"  {'fit | validate | test':24} train / validate / test a model (LightningCLI: YAML configs, "
             "dotted overrides)"]
    lines += [f"  {name:24} {help_}" for name, (_, help_) in COMMANDS.items()]
    return ("usage: normlab <command> [options]          (normlab <command> --help for each)\n\n"
            + "\n".join(lines) + "\n\n`normlab fit` with no options trains the default small model on the "
            "default corpus (a CPU is enough).\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `normlab` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(usage())
        return 0 if argv else 2
    command = argv[0]
    setup_logging()
    quiet_third_party()
    try:
        return run_command(command, argv)
    except Exception as err:
        if not is_user_error(err):
            raise
        return report_user_error(command, err)


def run_command(command: str, argv: list[str]) -> int:
    """`normlab <command> ...` (argv[0] is the command); user errors propagate to `main`."""
    if command in LIGHTNING_SUBCOMMANDS:
        # A fit's stop handlers go in first, before the seconds of imports below: a signal then must not kill it.
        stop = signals.install() if command == "fit" else None
        try:
            from training.cli_checks import check_config_files

            check_list_flags(argv[1:])
            # -c files that are no YAML mapping (or were edited since a sweep recorded them) are refused here, in
            # well under a second, before the seconds of Lightning's imports (the one place they are checked)
            check_config_files(argv[1:])
            from training.strategy import adopt_deepspeed_launcher_env

            adopt_deepspeed_launcher_env(os.environ)
            # LightningCLI reads sys.argv itself when args is None (and warns when given both).
            run_lightning(None if argv == sys.argv[1:] else argv)
        except Exception as err:
            from training.cluster.failure import collective_failure

            line = None if is_user_error(err) else collective_failure(err, stop.timeout.total_seconds() if stop
                                                                     else None)
            if line is None:
                raise
            sys.stderr.write(f"normlab {command}: error: {line}\n")
            return 1
        finally:
            if stop is not None:
                signals.uninstall()
        return 0
    if command in COMMANDS:
        check_flag_style(argv[1:])
        module, function = COMMANDS[command][0].split(":")
        with usage_errors_as_user_errors(command):
            return int(getattr(importlib.import_module(module), function)(argv[1:]) or 0)
    sys.stderr.write(f"normlab: unknown command {command!r}; choose one of "
                     f"{[*LIGHTNING_SUBCOMMANDS, *COMMANDS]}\n\n{usage()}")
    return 2


@contextmanager
def usage_errors_as_user_errors(command: str) -> Iterator[None]:
    """A plain command's argparse error (an invalid choice, a missing argument) is bad input like any other: one
    error line and exit status 2, instead of argparse's usage text. (`--help` still prints the usage.)"""
    def error(_parser: argparse.ArgumentParser, message: str) -> NoReturn:
        raise UserError(f"{message} (normlab {command} --help lists the options)")

    original = argparse.ArgumentParser.error  # (argparse's own exit_on_error=False misses missing arguments)
    argparse.ArgumentParser.error = error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = original


def check_flag_style(args: list[str]) -> None:
    """One flag style across normlab: underscores, as LightningCLI spells `fit`'s (`--ckpt_path`) and cannot
    change. A hyphenated flag — the plain commands' spelling before — is one error line naming the new one.
    (argparse reads such a token as an option, never as a value, so no value is caught.)"""
    for arg in args:
        if arg == "--":  # positional arguments follow
            return
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and "-" in flag[2:] and " " not in flag:  # (with a space argparse reads a value)
            raise UserError(f"{flag}: normlab's flags are spelled with underscores (as `normlab fit`'s are): "
                            f"use {'--' + flag[2:].replace('-', '_')}")


LIST_FLAGS = ("--loggers",)  # `fit`'s list-valued flags that read naturally as several words


def check_list_flags(args: list[str]) -> None:
    """LightningCLI takes a list as one value — `--loggers "[csv, wandb]"`, or `loggers: [csv, wandb]` in a `-c`
    file — as it does every list option. `--loggers csv wandb` would end in jsonargparse's "Expected a <class
    'list'>. Got value: csv"; this line names the form that works instead. (A `nargs` list would take the words but
    refuse the bracketed value that config files, sweeps and every other list flag use.)"""
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if flag not in LIST_FLAGS:
            continue
        words = [value] if eq else list(itertools.takewhile(lambda a: not a.startswith("-"), args[i + 1:]))
        if words and not words[0].lstrip().startswith("[") and words[0] != "null":
            raise UserError(f"{flag} {' '.join(words)}: give the list as one value: {flag} \"[{', '.join(words)}]\" "
                            f"(or {flag[2:]}: [{', '.join(words)}] in a -c file)")


def run_lightning(argv: list[str] | None) -> Any:
    """`normlab fit|validate|test ...`: build and run the LightningCLI."""
    from training.lightning_cli import NormlabCLI

    return NormlabCLI(args=argv)


if __name__ == "__main__":  # `python -m training.cli` — what the multi-process tests and launchers run
    sys.exit(main())
