"""The one error path of every console script.

A bad config, argument, file or checkpoint that reaches a command, wherever it is raised (argument
parsing, Hydra's composition, a library call, or inside ``pretrain``), ends as ONE line on stderr,

    PROG: error: MESSAGE

naming the field, file or value, and exit code 2. ``--debug`` on the command line, or
``HYDRA_FULL_ERROR=1`` (or ``ORYX_DEBUG=1``) in the environment, shows the traceback instead.

What counts as bad input is ``INPUT_ERRORS``: the errors the library raises with a message written
for the user. Anything else is a bug and keeps its traceback.
"""

import argparse
import os
import sys
from contextlib import contextmanager
from typing import Callable, List, Optional

from hydra.errors import HydraException, MissingConfigException
from omegaconf.errors import OmegaConfBaseException

from oryx_megatron.data_prep import PrepError

EXIT_CODE = 2
DEBUG_FLAG = "--debug"
DEBUG_VARIABLES = ("HYDRA_FULL_ERROR", "ORYX_DEBUG")


class InputError(Exception):
    """A bad input the command found itself; its message is the line to print."""


# ConfigError, LayoutError, ConversionError (ValueErrors) and CheckpointError (a FileNotFoundError) included
INPUT_ERRORS = (InputError, PrepError, OSError, ValueError, KeyError, HydraException, OmegaConfBaseException)


def debugging(argv: Optional[List[str]] = None) -> bool:
    """Whether errors show their traceback: ``--debug`` in argv, or a DEBUG_VARIABLES variable set (not 0)."""
    return DEBUG_FLAG in (argv or []) or any(os.environ.get(v, "") not in ("", "0") for v in DEBUG_VARIABLES)


def one_line(error: BaseException) -> str:
    """The message of ``error`` as one line: a file error names its file, a missing key its key, a Hydra
    composition error its cause (or the options it had)."""
    if isinstance(error, OSError) and error.filename is not None:
        text = f"{error.filename}: {error.strerror or error}"
    elif isinstance(error, KeyError):
        text = f"missing key {error.args[0]!r}" if error.args else "missing key"
    else:
        text = str(error)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[0] if lines else type(error).__name__
    if isinstance(error, MissingConfigException) and error.options:
        line += f" (available: {', '.join(error.options)})"
    elif isinstance(error, HydraException) and isinstance(error.__cause__, OmegaConfBaseException):
        line = f"{line.rstrip('.')}: {one_line(error.__cause__)}"
    return line


def report(prog: str, error: BaseException) -> int:
    """Print the error's line; the exit code."""
    print(f"{prog}: error: {one_line(error)}", file=sys.stderr, flush=True)
    return EXIT_CODE


@contextmanager
def error_path(prog: str, debug: bool, cleanup: Optional[Callable[[], None]] = None):
    """Inside: an INPUT_ERRORS exception runs ``cleanup`` (what the failed command would leave behind), then
    exits with its one line, or, ``debug``, propagates with its traceback."""
    try:
        yield
    except INPUT_ERRORS as e:
        if cleanup is not None:
            cleanup()
        if debug:
            raise
        sys.exit(report(prog, e))


def run_command(prog: str, body: Callable[[List[str]], int], argv: Optional[List[str]] = None) -> int:
    """``body(argv)`` (argv: sys.argv[1:] by default) through the error path; its exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with error_path(prog, debugging(argv)):
        return body(argv)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors take the one error path (an InputError) instead of printing the usage and
    exiting; with the ``--debug`` flag."""

    def __init__(self, *args, debug_flag: bool = True, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        if debug_flag:
            self.add_argument(DEBUG_FLAG, action="store_true", help="on an error, show its traceback")

    def error(self, message: str):
        raise InputError(message)


def command_parser(prog: str, doc: str) -> ArgumentParser:
    """The parser of a console script documented by ``doc`` (its first line: the description; all: the epilog)."""
    return ArgumentParser(prog=prog, description=doc.split("\n")[0], epilog=doc)
