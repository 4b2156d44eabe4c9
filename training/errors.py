"""User errors: what every `normlab <command>` reports as one line, and what stays a traceback.

A user error is bad input the user can fix — a config value, a path, a checkpoint that does not fit the run.
`normlab` prints it as `normlab <command>: error: <what> <how to fix>` and exits with status 2, without a
traceback (`NORMLAB_DEBUG=1` shows it). A full disk (or quota) is reported the same way, naming the file.
Anything else is a bug, or an event during training such as a non-finite gradient (see callbacks/guard.py), and
keeps its traceback.
"""
from __future__ import annotations

import argparse
import errno
import os
import sys

DEBUG_ENV = "NORMLAB_DEBUG"
EXIT_USER_ERROR = 2  # as argparse's usage errors


class UserError(ValueError):
    """Bad input that the user can fix; the message names the field, value or file and says how."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete, unreadable or does not fit this run; the message names the path
    and the fix."""


def is_user_error(err: BaseException) -> bool:
    """Whether `err` is bad input rather than a bug: normlab's own error types, a command-line parse error
    (jsonargparse), or a setting Lightning refuses (`MisconfigurationException`)."""
    from data.errors import DataError

    if isinstance(err, (UserError, DataError)):
        return True
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):  # a full disk: free space, rerun
        return True
    if isinstance(err, argparse.ArgumentError):  # what jsonargparse raises (exit_on_error=False, see lightning_cli)
        return True
    exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")  # loaded with Lightning, never here
    return exceptions is not None and isinstance(err, exceptions.MisconfigurationException)


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def report_user_error(command: str, err: BaseException) -> int:
    """Print `err` as the one error line of `normlab <command>` and return the exit status (re-raise it under
    NORMLAB_DEBUG=1, for its traceback)."""
    if debug():
        raise err
    message = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        message = f"the disk is full ({message}): free space, then run the command again"
    sys.stderr.write(f"normlab {command}: error: {message}\n")
    return EXIT_USER_ERROR
