"""What the two command lines, ``kvblend`` and ``kvblend bench``, share: one-line errors, checks.

A user mistake is one line on stderr and exit status 2. argparse's own errors print a usage
block first; `OneLineParser` prints the error alone and says where the help is. `check_device`
refuses a device this machine's PyTorch cannot use before any model is loaded (loading first
and failing in ``model.to`` costs seconds and prints a long traceback). `positive_int` is an
argparse type, `printable` escapes what a terminal cannot show.

Both command lines stand on this module and on nothing of each other.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class CLIError(Exception):
    """A user mistake (exit status 2), or work that could not be kept (`status` 1): one line."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``PROG: error: ...``), exit status 2.

    argparse prints the usage block before the error; here the error line says where the help
    is instead. A missing subcommand names the subcommands there are.
    """

    def error(self, message: str) -> NoReturn:  # noqa: D102 - argparse's hook
        commands = _subcommands(self)
        if commands and "required: COMMAND" in message:
            message = f"choose a command: {', '.join(commands)}"
        self.exit(2, printable(f"{self.prog}: error: {message} (see {self.prog} --help)\n"))


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    for action in parser._actions:  # noqa: SLF001 - argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return list(action.choices)
    return []


def printable(text: str) -> str:
    """``text`` with lone surrogates (undecodable bytes of arguments or file names) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def positive_int(text: str) -> int:
    """Argparse type: an int of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def check_device(name: str) -> None:
    """Refuse a device this machine's torch cannot use, before any model is loaded."""
    if name == "auto":
        return
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CLIError(f"unknown device {name!r}; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.backends.cuda.is_built():
            raise CLIError(
                f"--device {name}: this PyTorch ({torch.__version__}) is built without CUDA; "
                "use --device cpu or install a CUDA build of PyTorch"
            )
        if not torch.cuda.is_available():
            raise CLIError(f"--device {name}: no CUDA device is available; use --device cpu")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise CLIError(f"--device {name}: this machine has {count} CUDA device(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise CLIError(f"--device {name}: MPS is not available on this machine")
    elif device.type != "cpu":
        raise CLIError(f"unsupported device {name!r}; use auto, cpu, cuda, cuda:N or mps")
