"""What reaches a user's console: normlab's own log lines (`setup_logging`), and from the libraries under normlab
the lines a user cannot act on, silenced (`quiet_third_party`).

`quiet_third_party()` runs first in every `normlab` command (training/cli.py `main`), on every rank (Lightning's
spawned ranks and the launchers' re-enter `main` too). Each entry below names one message, by category and by
the module that emits it, so that a new warning — and every warning about the user's own config, such as a
Lightning `PossibleUserWarning` about too few workers or a deprecated trainer flag — still shows. A new entry
needs a reason a user can do nothing about the message; tests/test_console.py fails on any line not normlab's.

`NORMLAB_DEBUG=1` installs none of them: everything prints. Nothing here imports Lightning, DeepSpeed or torch:
`normlab prepare` must not pay for them, and the filters are in place before any of them is imported.
"""
from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from training.cluster.rank import launcher_rank
from training.errors import debug

# (category, message regex, emitting module regex, why a user cannot act on it). warnings.filterwarnings matches
# the message from its start and the module against the `__name__` of the code that called warnings.warn.
WARNINGS: tuple[tuple[type[Warning], str, str, str], ...] = (
    # Lightning's own pytree helper builds a torch LeafSpec, which torch 2.10+ deprecates: Lightning's to fix.
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated", r"lightning\.pytorch\.utilities\._pytree",
     "Lightning internals"),
    # normlab's token datasets are iterable with a length (the epoch size) and split their samples between
    # DataLoader workers themselves (data/dataset.py), which is what this warning asks a dataset to do.
    (UserWarning, r"Your `IterableDataset` has `__len__` defined", r"lightning\.pytorch\.utilities\.data",
     "normlab's dataset already shards across workers"),
    # Lightning sees `srun` on the PATH and advises prefixing the command with it. normlab's launchers
    # (scripts/slurm.sbatch runs `srun normlab fit`, Lightning then reads the Slurm environment), torchrun,
    # the deepspeed launcher and a sweep's local executor start their processes themselves: the advice is wrong.
    (UserWarning, r"The `srun` command is available on your system but is not used",
     r"lightning\.fabric\.plugins\.environments\.slurm", "wrong for normlab's launchers"),
    # `normlab.cli.main(argv)` (an API: the tests, scripts) hands LightningCLI its own arguments beside the
    # process's sys.argv; the advice is for scripts that call LightningCLI directly. `normlab fit` passes none.
    (UserWarning, r"LightningCLI's args parameter is intended", r"lightning\.pytorch\.cli",
     "normlab's main(argv) passes its arguments on purpose"),
    # DeepSpeed's ZeRO collectives call torch.distributed.all_gather_into_tensor, deprecated in torch 2.10+.
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated", r"torch\.distributed\.c10d_logger",
     "DeepSpeed internals"),
)

# (logger name, message prefix): log records (not warnings) dropped at the one logger that emits them.
LOG_RECORDS: tuple[tuple[str, str], ...] = (
    # An advertisement for a hosted logging service, on every fit, validate and test.
    ("lightning.pytorch.utilities.rank_zero", "💡 Tip: For seamless cloud logging"),
    ("lightning.fabric.utilities.rank_zero", "💡 Tip: For seamless cloud logging"),
    # DeepSpeed on a machine without a GPU: Lightning's own "GPU available: False" line already says so.
    ("DeepSpeed", "Setting accelerator to CPU. If you have GPU or other accelerator"),
)


class _DropPrefix(logging.Filter):
    """Drops the records of one logger whose message starts with `prefix`."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_third_party() -> None:
    """Install the filters above (idempotent: a second call, e.g. a test running several commands in one
    process, adds nothing). NORMLAB_DEBUG=1 leaves every line in, as it leaves every traceback."""
    if debug():
        return
    for category, message, module, _ in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, prefix in LOG_RECORDS:
        logger = logging.getLogger(name)  # the very logger the library creates later under that name
        if not any(isinstance(f, _DropPrefix) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropPrefix(prefix))


def _is_rank_zero() -> bool:
    """Lightning's notion of the global rank once it is imported and set; the launcher's before."""
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")  # home of Lightning's rank_zero_only
    rank = getattr(getattr(rank_zero, "rank_zero_only", None), "rank", None)
    return launcher_rank() == 0 if rank is None else rank == 0


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever `sys.stderr` is when a record is written (not the one at set-up): a caller
    that redirects stderr, such as a test capturing one command after another, gets normlab's log lines too."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def setup_logging() -> None:
    """INFO from normlab's own loggers on rank 0; warnings and errors from every rank. (Without importing
    Lightning: `normlab prepare` should not pay for it.)"""
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s %(name)s] %(message)s", "%H:%M:%S"))
    handler.addFilter(lambda record: record.levelno >= logging.WARNING or _is_rank_zero())
    for name in ("training", "data", "model"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False  # a command's own basicConfig must not print each line twice


class StartupLines:
    """Holds the lines a run prints while it starts — Lightning's start-up report (`Seed set to ...`, which
    accelerators it found) and normlab's warnings about the config — until `release`, once every check of the
    start has passed: a start refused for bad input then prints its one error line and nothing before it
    (`drop`). Installed on the handlers of Lightning's loggers and of normlab's own; other records pass."""

    HELD = ("lightning.", "training.cli_checks")

    def __init__(self) -> None:
        self.held: list[tuple[logging.Handler, logging.LogRecord]] = []
        self.handlers: list[logging.Handler] = []

    def holds(self, record: logging.LogRecord) -> bool:
        return record.name.startswith(self.HELD)

    @classmethod
    def hold(cls) -> StartupLines:
        """Hold from now on (not under NORMLAB_DEBUG, where every line prints as it comes)."""
        lines = cls()
        if debug():
            return lines
        for name in ("lightning.pytorch", "lightning.fabric", "training"):
            for handler in logging.getLogger(name).handlers:
                handler.addFilter(_Holder(lines, handler))
                lines.handlers.append(handler)
        return lines

    def release(self) -> None:
        """Print the held lines (each by the handler that held it) and stop holding."""
        held, self.held = self.held, []
        self.drop()
        for handler, record in held:
            handler.handle(record)

    def drop(self) -> None:
        """Stop holding, printing nothing held (a refused start: its error line says all)."""
        for handler in self.handlers:
            for f in [f for f in handler.filters if isinstance(f, _Holder) and f.lines is self]:
                handler.removeFilter(f)
        self.handlers, self.held = [], []


class _Holder(logging.Filter):
    """`StartupLines`' filter on one handler: keeps the held records with the handler to print them."""

    def __init__(self, lines: StartupLines, handler: logging.Handler) -> None:
        super().__init__()
        self.lines, self.handler = lines, handler

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.lines.holds(record):
            return True
        self.lines.held.append((self.handler, record))
        return False
