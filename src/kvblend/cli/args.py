"""Options of the ``kvblend`` command line: what each command lists, and their defaults.

Each command lists only the options it uses: `add_model_options` for every command that loads
the model, `add_blend_options` for those that blend (``--max-new-tokens`` for those that also
generate), `add_chunk_option` for those that read document files. The one-line errors, the
argument types and the device check are `kvblend.command_line`'s (``kvblend bench`` uses them
too).
"""

from __future__ import annotations

import argparse

from kvblend.command_line import positive_int

#: Strategies and defaults the help shows; importing the engine (torch) only to print help
#: would cost seconds. tests/cli/test_cli_precompute.py checks them against `BlendConfig`.
STRATEGIES = ("attention", "cacheblend", "epic", "reuse", "full")
#: Each strategy's default ``recompute_ratio`` and ``correction``, for those that have one.
DEFAULT_RATIO = {"attention": 0.3, "cacheblend": 0.2}
DEFAULT_CORRECTION = {"attention": 0.75, "cacheblend": 0.5, "epic": 0.5}
#: `kvblend.blend.kv_codec.CODECS`, named here for the same reason (checked by the same test).
KV_CODECS = ("none", "int8", "k8v4", "int4")


def _per_strategy(defaults: dict[str, float]) -> str:
    """``0.75 for attention, 0.5 for cacheblend and epic``: strategies of one value together."""
    values: dict[float, list[str]] = {}
    for name, value in defaults.items():
        values.setdefault(value, []).append(name)
    return ", ".join(f"{value} for {' and '.join(names)}" for value, names in values.items())


def add_model_options(p: argparse.ArgumentParser) -> None:
    """Options of every command that loads the model."""
    p.add_argument("--model", help="model folder, GGUF file or hub id (default: bundled)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ... (default auto)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "float32", "bf16", "bfloat16", "fp16", "float16"],
        help="the model's dtype; auto (default): bf16 where the device has bfloat16 "
        "matrix units (CUDA, a CPU with AVX512-BF16 or AMX) unless the "
        "checkpoint is float32, else fp32; float32 is the exact reference. "
        "Stored KV is keyed by it, so precompute in the dtype you ask or serve "
        "in (a vLLM server's --dtype)",
    )
    p.add_argument("--store-dir", help="KV store folder (default: user cache dir)")
    p.add_argument("--memory-only", action="store_true", help="keep KV in memory only")
    p.add_argument(
        "--system",
        default=None,
        help="system prompt of the RAG prompt; documents are precomputed behind "
        "it, so use the same one for precompute and ask (default: "
        "'Answer the question using only the documents.')",
    )
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch CPU threads (default: the physical cores the last minute's "
        "load leaves idle, at least 1)",
    )
    add_quiet_option(p)
    p.add_argument(
        "--kv-codec",
        default="none",
        choices=KV_CODECS,
        help="how documents' KV is stored: none (full precision), int8, k8v4 "
        "(8-bit keys, 4-bit values) or int4; part of each entry's identity, "
        "so use the same one for precompute and ask (default none)",
    )


def add_quiet_option(p: argparse.ArgumentParser) -> None:
    """``--quiet``: no progress bars and no lines about loading or precomputing."""
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bars and no lines about loading and precomputing (results, "
        "warnings and errors are still printed; bars show only on a "
        "terminal)",
    )


def add_blend_options(p: argparse.ArgumentParser, *, decodes: bool = True) -> None:
    """Options of the commands that blend (``decodes``: and generate text)."""
    p.add_argument(
        "--strategy",
        default=STRATEGIES[0],
        help=f"how reused tokens are chosen for recompute: {', '.join(STRATEGIES)} "
        "(default %(default)s)",
    )
    p.add_argument(
        "--ratio",
        type=float,
        default=None,
        help="recompute ratio for attention and cacheblend "
        f"(default {_per_strategy(DEFAULT_RATIO)})",
    )
    p.add_argument(
        "--deviation",
        default=None,
        choices=["value", "key"],
        help="cacheblend's deviation metric (default value)",
    )
    p.add_argument(
        "--correction",
        type=float,
        default=None,
        help="share of the recomputed tokens' mean KV change added to the other "
        "tokens of their document, for attention, cacheblend and epic "
        f"(default {_per_strategy(DEFAULT_CORRECTION)}; 0: off)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="NAME=VALUE",
        help="any other setting of the strategy, such as lead_tokens=16 or "
        "short_document=0 (docs/configuration.md); repeatable",
    )
    if decodes:
        p.add_argument(
            "--max-new-tokens",
            type=positive_int,
            default=24,
            help="tokens to generate at most, fewer than the model's context "
            "window (default %(default)s)",
        )


#: Tokens of a chunk of a file too long for the model (``--chunk-tokens``).
DEFAULT_CHUNK_TOKENS = 512


def add_chunk_option(p: argparse.ArgumentParser, *, always: bool = False) -> None:
    """``--chunk`` and ``--chunk-tokens``, for the commands that read document files.

    ``always``: the command splits such files anyway (``ask``); ``--chunk`` is accepted.
    """
    p.add_argument(
        "--chunk",
        action="store_true",
        help=argparse.SUPPRESS
        if always
        else "split a file longer than the model's context window into chunks of "
        "--chunk-tokens tokens, each stored as a document (default: skip it, "
        "naming it)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=positive_int,
        default=DEFAULT_CHUNK_TOKENS,
        metavar="N",
        help="tokens of a chunk of a file too long for the model (default "
        "%(default)s; use the same for precompute and ask)",
    )
