"""Options and argument checks of the ``kvblend`` command line: one-line errors, devices, counts.

Each command lists only the options it uses: `add_model_options` for every command that loads
the model, `add_blend_options` for those that blend (``--max-new-tokens`` for those that also
generate), `add_chunk_option` for those that read document files.

A user mistake is one line on stderr and exit status 2. argparse's own errors print a usage
block first; `OneLineParser` prints the error alone and says where the help is. `check_device`
refuses a device this machine's PyTorch cannot use before any model is loaded (loading first
and failing in ``model.to`` costs seconds and prints a long traceback).
"""

from __future__ import annotations

import argparse
from typing import NoReturn

#: Strategies and defaults the help shows; importing the engine (torch) only to print help
#: would cost seconds. tests/cli/test_cli.py checks them against `BlendConfig`.
STRATEGIES = ("attention", "cacheblend", "epic", "reuse", "full")
DEFAULT_RATIO = 0.2
DEFAULT_CORRECTION = 0.5
#: `kvblend.blend.kv_codec.CODECS`, named here for the same reason (checked by the same test).
KV_CODECS = ("none", "int8", "k8v4", "int4")


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


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that loads the model."""
    p.add_argument("--model", help="model folder, GGUF file or hub id (default: bundled)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default auto)")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16"],
                   help="the model's dtype; auto (default): bf16 where the device has bfloat16 "
                        "matrix units (CUDA, a CPU with AVX512-BF16 or AMX) unless the "
                        "checkpoint is float32, else fp32; float32 is the exact reference. "
                        "Stored KV is keyed by it, so precompute in the dtype you ask or serve "
                        "in (a vLLM server's --dtype)")  # fmt: skip
    p.add_argument("--store-dir", help="KV store folder (default: user cache dir)")
    p.add_argument("--memory-only", action="store_true", help="keep KV in memory only")
    p.add_argument("--system", default=None,
                   help="system prompt of the RAG prompt; documents are precomputed behind "
                        "it, so use the same one for precompute and ask (default: "
                        "'Answer the question using only the documents.')")  # fmt: skip
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: the physical cores the last minute's "
                        "load leaves idle, at least 1)")  # fmt: skip
    add_quiet_option(p)
    p.add_argument("--kv-codec", default="none", choices=KV_CODECS,
                   help="how documents' KV is stored: none (full precision), int8, k8v4 "
                        "(8-bit keys, 4-bit values) or int4; part of each entry's identity, "
                        "so use the same one for precompute and ask (default none)")  # fmt: skip


def add_quiet_option(p: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress bars and no lines about loading or precomputing."""
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bars and no lines about loading and precomputing (results, "
                        "warnings and errors are still printed; bars show only on a "
                        "terminal)")  # fmt: skip


def add_blend_options(p: argparse.ArgumentParser, *, decodes: bool = True) -> None:
    """Options of the commands that blend (``decodes``: and generate text)."""
    p.add_argument(
        "--strategy",
        default=STRATEGIES[0],
        help=f"how reused tokens are chosen for recompute: {', '.join(STRATEGIES)} "
        "(default %(default)s)",
    )
    p.add_argument("--ratio", type=float, default=None,
                   help="recompute ratio for attention and cacheblend "
                        f"(default {DEFAULT_RATIO})")  # fmt: skip
    p.add_argument("--deviation", default=None, choices=["value", "key"],
                   help="cacheblend's deviation metric (default value)")  # fmt: skip
    p.add_argument("--correction", type=float, default=None,
                   help="share of the recomputed tokens' mean KV change added to the other "
                        "tokens of their document, for attention, cacheblend and epic "
                        f"(default {DEFAULT_CORRECTION}; 0: off)")  # fmt: skip
    p.add_argument("--set", action="append", metavar="NAME=VALUE",
                   help="any other setting of the strategy, such as lead_tokens=16 or "
                        "short_document=0 (docs/configuration.md); repeatable")  # fmt: skip
    if decodes:
        p.add_argument("--max-new-tokens", type=positive_int, default=24,
                       help="tokens to generate at most, fewer than the model's context "
                            "window (default %(default)s)")  # fmt: skip


#: Tokens of a chunk of a file too long for the model (``--chunk-tokens``).
DEFAULT_CHUNK_TOKENS = 512


def add_chunk_option(p: argparse.ArgumentParser, *, always: bool = False) -> None:
    """``--chunk`` and ``--chunk-tokens``, for the commands that read document files.

    ``always``: the command splits such files anyway (``ask``); ``--chunk`` is accepted.
    """
    p.add_argument("--chunk", action="store_true",
                   help=argparse.SUPPRESS if always else
                   "split a file longer than the model's context window into chunks of "
                   "--chunk-tokens tokens, each stored as a document (default: skip it, "
                   "naming it)")  # fmt: skip
    p.add_argument("--chunk-tokens", type=positive_int, default=DEFAULT_CHUNK_TOKENS,
                   metavar="N",
                   help="tokens of a chunk of a file too long for the model (default "
                        "%(default)s; use the same for precompute and ask)")  # fmt: skip
