"""The ``kvblend`` command line: demo, precompute, ask, explain, store, bench.

Every user mistake (a bad option, a missing file, an unknown device or model) is one line on
stderr and exit status 2, found before the model loads wherever it can be: a traceback is for
bugs, not for typos. The engine (and torch) is imported only by the command that runs, so
``kvblend --help`` answers at once.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvblend.cli.args import (
    add_blend_options,
    add_chunk_option,
    add_model_options,
    add_quiet_option,
)
from kvblend.cli.precompute import (
    DocumentFiles,
    fitting_documents,
    list_files,
    not_kept,
    precompute_each,
    unstored_files,
)
from kvblend.cli.report import PrecomputeTally, interrupted, plural, summary
from kvblend.cli.store import add_store_parser
from kvblend.command_line import CLIError, OneLineParser, check_device, positive_int, printable

if TYPE_CHECKING:
    from kvblend.blend.config import BlendConfig
    from kvblend.engine.engine import BlendEngine

    Subcommands = argparse._SubParsersAction[OneLineParser]  # noqa: SLF001

logger = logging.getLogger("kvblend")

#: Document tokens ``ask`` puts in one prompt at most, and how many it retrieves.
DEFAULT_PROMPT_TOKENS = 4096
DEFAULT_TOP_K = 6


def _check_arguments(args: argparse.Namespace) -> None:
    """Refuse bad settings, text arguments and environment settings before the model loads."""
    if hasattr(args, "strategy"):
        _config(args)  # a bad setting fails before the model loads
    if hasattr(args, "device"):
        check_device(args.device)
        from kvblend.decoding.cache import check_environment

        check_environment()  # KVBLEND_DECODE_CACHE, KVBLEND_DECODE_COMPILE
    from kvblend.validation import check_text

    for name in ("question", "system", "prompt"):
        value = getattr(args, name, None)
        if value is not None:
            try:
                check_text(value, f"the {name} argument")
            except ValueError as error:
                raise CLIError(str(error)) from None
            if name != "system" and not value.strip():
                raise CLIError(f"the {name} is empty")


def load_sample_corpus() -> dict[str, Any]:
    """Load the demo corpus shipped inside the package (`kvblend.samples.sample_corpus`)."""
    from kvblend.samples import sample_corpus

    return sample_corpus()


def _quiet_transformers() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def _config(args: argparse.Namespace) -> BlendConfig:
    """Return the blend settings given on the command line.

    A setting the strategy does not use is an error (one line), never silently ignored.
    """
    from kvblend.blend.config import BlendConfig, parse_setting

    options = {
        "recompute_ratio": args.ratio,
        "deviation": args.deviation,
        "correction": args.correction,
    }
    given = {name: value for name, value in options.items() if value is not None}
    for text in getattr(args, "set", None) or []:
        name, value = parse_setting(text)
        if name in given:
            raise ValueError(f"setting {name} is given twice")
        given[name] = value
    try:
        return BlendConfig(args.strategy, **given)
    except ValueError as error:
        flags = {
            "recompute_ratio": "--ratio",
            "deviation": "--deviation",
            "correction": "--correction",
        }
        message = str(error)
        for name, flag in flags.items():
            message = message.replace(repr(name), flag)
        raise ValueError(message) from None


def _engine(
    args: argparse.Namespace, system: str | None = None, *, keeps: bool = False
) -> BlendEngine:
    """Load the engine over the command's store (``keeps``: the command is there to fill it)."""
    import torch

    from kvblend.engine.engine import DEFAULT_SYSTEM_PROMPT, BlendEngine

    _quiet_transformers()
    store = _store(args, keeps=keeps)
    _say(args, f"loading model {_model_source(args)} ...")
    started = time.perf_counter()
    if args.system is not None:
        system = args.system
    engine = BlendEngine.from_pretrained(
        args.model,
        store=store,
        device=args.device,
        system_prompt=DEFAULT_SYSTEM_PROMPT if system is None else system,
        threads=args.threads,
        kv_codec=getattr(args, "kv_codec", None),
        dtype=getattr(args, "dtype", "auto"),
    )
    _say(
        args,
        f"loaded {engine.name} on {engine.decoder.device} in {time.perf_counter() - started:.1f} s "
        f"in {engine.dtype_choice} (parity self-check error {engine.parity_error:.1e}; "
        f"{torch.get_num_threads()} CPU thread(s))",
    )
    budget = getattr(args, "max_new_tokens", None)
    if budget is not None and budget >= engine.context_window:
        raise CLIError(
            f"--max-new-tokens {budget} leaves no room for a prompt in {engine.name}'s context "
            f"window of {engine.context_window} tokens"
        )
    return engine


def _say(args: argparse.Namespace, line: str) -> None:
    """Print a line about the command's progress on stderr, unless ``--quiet``."""
    if not getattr(args, "quiet", False):
        print(printable(line), file=sys.stderr, flush=True)


def _model_source(args: argparse.Namespace) -> str:
    """Name the model the command loads as the user named it (or where it comes from)."""
    from kvblend.models.loading import MODEL_ENV

    if args.model:
        return str(args.model)
    from_env = os.environ.get(MODEL_ENV)
    if from_env:
        return f"{from_env} (${MODEL_ENV})"
    return "(bundled default)"


def _tally(args: argparse.Namespace) -> PrecomputeTally:
    return PrecomputeTally(quiet=getattr(args, "quiet", False))


def _progress(args: argparse.Namespace) -> bool:
    """Whether precompute shows its bar: not under ``--quiet`` (tqdm: only on a terminal)."""
    return not getattr(args, "quiet", False)


def _store(args: argparse.Namespace, *, keeps: bool = False):  # noqa: ANN202
    """Return the command's store: memory in front of the folder, which must be usable.

    A command writes what it computes into the folder (the engine and the adapters, serving,
    fall back to memory instead: there answering matters more). So a folder that cannot be
    used fails the command at once, in one line, before the model loads, and so does a
    read-only one for a command that is there to fill it (``keeps``); the others read a
    read-only folder, saying that nothing they compute is kept.
    """
    from kvblend.store import MemoryKVStore, StoreError, default_store, default_store_dir

    if getattr(args, "memory_only", False):
        return MemoryKVStore()
    folder = getattr(args, "store_dir", None) or default_store_dir()
    try:
        store = default_store(folder, disk_required=True)
    except StoreError as error:
        raise CLIError(
            f"{error}; nothing computed here could be kept (--memory-only keeps KV in memory, "
            "for this command only)"
        ) from None
    if store.disk is not None and store.disk.read_only:
        if keeps:
            raise CLIError(
                f"the KV store in {store.disk.directory} is read-only: nothing precomputed "
                "could be kept"
            )
        logger.warning(
            "the KV store in %s is read-only: what is computed here is not kept",
            store.disk.directory,
        )
    return store


def _check_kept(engine: BlendEngine, files: DocumentFiles, *, fail: bool) -> None:
    """Name what the store did not keep: fail (status 1) with ``fail``, else warn."""
    lost = unstored_files(files, not_kept(engine.store, files.stored))
    if lost is None:
        return
    message = f"not stored: {lost} (see the warnings above)"
    if fail:
        raise CLIError(message, status=1)
    logger.warning(printable(message))


def _read(paths: Sequence[str], files: DocumentFiles) -> list[tuple[str, str]]:
    """Return the ``(name, text)`` of every document file of ``paths`` (before the model loads)."""
    from kvblend.cli.precompute import read_files

    return read_files(list_files(paths, files), files)


def cmd_demo(args: argparse.Namespace) -> None:
    """Precompute the sample corpus, then answer its questions with full and blended prefill."""
    corpus = load_sample_corpus()
    documents = [d["text"] for d in corpus["documents"]]
    questions = corpus["questions"][: args.questions]
    engine = _engine(args, corpus.get("system"))
    named = [(document["title"], document["text"]) for document in corpus["documents"]]
    precompute_each(engine, named, tally=_tally(args), progress=_progress(args))
    _say_where(args, engine)
    config = _config(args)
    from kvblend.blend.config import BlendConfig

    setting = f"strategy: {config.strategy}" + "".join(
        f", {name.replace('_', ' ')} {value}" for name, value in config.settings.items()
    )
    print(f"\n{setting}; {len(documents)} documents, shuffled per question\n")
    speedups, correct_full, correct_blended = [], 0, 0
    for item in questions:
        order = documents[:]
        random.Random(f"{args.seed}:{item['question']}").shuffle(order)  # per question
        segments = engine.rag_segments(item["question"], order)
        full = engine.generate(segments, BlendConfig("full"), max_new_tokens=args.max_new_tokens)
        blended = engine.generate(segments, config, max_new_tokens=args.max_new_tokens)
        full_answer, answer = " ".join(full.text.split()), " ".join(blended.text.split())
        full_ok = item["answer"].lower() in full_answer.lower()
        blended_ok = item["answer"].lower() in answer.lower()
        correct_full += full_ok
        correct_blended += blended_ok
        speedups.append(full.ttft_s / blended.ttft_s)
        print(f"Q: {item['question']}  (expected: {item['answer']})")
        print(f"  full prefill  TTFT {full.ttft_s:5.2f} s  {'+' if full_ok else '-'} {full_answer}")
        print(
            f"  blended       TTFT {blended.ttft_s:5.2f} s  {'+' if blended_ok else '-'} {answer}"
        )
        print(f"  speedup {speedups[-1]:.1f}x\n")
    stats = blended.stats
    print(
        f"\nExpected answer found: full prefill {correct_full}/{len(questions)}, blended "
        f"{correct_blended}/{len(questions)}. Last prompt: {token_counts(stats)}"
        f"{fallback_clause(stats)}. "
        f"Median TTFT speedup {sorted(speedups)[len(speedups) // 2]:.1f}x."
    )


def _say_where(args: argparse.Namespace, engine: BlendEngine) -> None:
    """Say where the demo's KV is kept, how much the store holds, and how to remove it."""
    disk = getattr(engine.store, "disk", None)
    if disk is None:
        return
    size = disk.stats().bytes / 2**20
    _say(
        args,
        f"the documents' KV is kept in {disk.directory} (the store there holds {size:.0f} MiB; "
        "`kvblend store clear` deletes it, --memory-only keeps it in memory)",
    )


def cmd_precompute(args: argparse.Namespace) -> None:
    """Precompute and store the KV of every document file; name (and skip or chunk) the rest.

    The last line counts the documents stored here, those already stored and the files skipped
    apart. Exit status 1 when nothing was stored (every document skipped) or the store did not
    keep a document; Ctrl-C says what was kept (status 130), and a rerun resumes from there.
    """
    files = DocumentFiles()
    named = _read(args.paths, files) if args.paths else []  # before the model loads
    if args.samples:
        corpus = load_sample_corpus()["documents"]
        named += [(f"sample: {document['title']}", document["text"]) for document in corpus]
    if not named and not files.skipped:
        raise CLIError("nothing to precompute: name text files or folders, or --samples")
    engine = _engine(args, keeps=True)
    started = time.perf_counter()
    documents = fitting_documents(
        engine, named, chunk=args.chunk, files=files, chunk_tokens=args.chunk_tokens
    )
    tally = _tally(args)
    try:
        precompute_each(engine, documents, files, tally=tally, progress=_progress(args))
    except KeyboardInterrupt:
        print(printable(interrupted(tally, len(documents))), file=sys.stderr, flush=True)
        raise
    _check_kept(engine, files, fail=True)
    line = summary(tally, len(files.skipped), time.perf_counter() - started)
    if not tally.stored:
        raise CLIError(line, status=1)
    print(line)
    _print_stats(engine.store.stats())


def cmd_ask(args: argparse.Namespace) -> None:
    """Answer a question over documents with blended prefill.

    Every document goes into the prompt when they all fit its budget of document tokens; else
    the ``--top-k`` most relevant to the question that fit (`kvblend.cli.retrieval`), named on
    stderr. A file longer than the model's window is split into chunks. Only the documents in
    the prompt are precomputed.
    """
    files = DocumentFiles()
    read = _read(args.docs, files)  # before the model loads
    engine = _engine(args)
    budget = _prompt_budget(args, engine)
    units = fitting_documents(
        engine,
        read,
        chunk=True,
        files=files,
        chunk_tokens=args.chunk_tokens,
        longest=budget - PER_DOCUMENT_TOKENS,
    )
    if not units:
        raise CLIError("no document fits the model (named above)", status=1)
    named = _prompt_documents(args, engine, units, budget)
    precompute_each(engine, named, files, tally=_tally(args), progress=_progress(args))
    _check_kept(engine, files, fail=False)
    documents = [text for _, text in named]
    if not documents:
        raise CLIError("no document could be precomputed (named above)", status=1)
    segments = engine.rag_segments(args.question, documents)
    try:
        engine.plan(segments)  # one prompt holds every document: it must fit the window
    except ValueError as error:
        raise CLIError(
            f"{error}: the question and {len(documents)} document(s) are one prompt; lower "
            "--prompt-tokens or --top-k"
        ) from None
    from kvblend.blend.config import BlendConfig

    if args.compare:
        full = engine.generate(segments, BlendConfig("full"), max_new_tokens=args.max_new_tokens)
        print(f"full prefill  ({full.ttft_s:.2f} s to first token): {full.text.strip()}")
    out = engine.generate(segments, _config(args), max_new_tokens=args.max_new_tokens)
    if args.compare:
        print(f"blended       ({out.ttft_s:.2f} s to first token): {out.text.strip()}")
    else:
        print(out.text.strip())
    print(
        f"[{token_counts(out.stats)}; TTFT {out.ttft_s:.2f} s{fallback_clause(out.stats)}]",
        file=sys.stderr,
    )


#: Prompt tokens ``ask`` counts for each document beyond its own: the separator, and slack.
PER_DOCUMENT_TOKENS = 4


def token_counts(stats: Any) -> str:  # noqa: ANN401 - a BlendStats
    """Say a prefill's prompt tokens as reused, recomputed and computed (docs/glossary.md).

    A full prefill (a fallback) still reuses the cached prefix (the prompt head, and a document
    right after the text it was precomputed behind): its reused tokens are said to be those.
    """
    head = " (the cached prefix)" if stats.fallback and stats.reused_tokens else ""
    return (
        f"{stats.prompt_tokens} prompt tokens: {stats.reused_tokens} reused{head}, "
        f"{stats.recomputed_tokens} recomputed, {stats.computed_tokens} computed"
    )


def fallback_clause(stats: Any) -> str:  # noqa: ANN401 - a BlendStats
    """Return ``; ran as full prefill after the cached prefix: WHY`` for a fallback, or ""."""
    if not stats.fallback:
        return ""
    return f"; ran as full prefill after the cached prefix: {stats.fallback}"


def _prompt_budget(args: argparse.Namespace, engine: BlendEngine) -> int:
    """Return the document tokens ``ask``'s prompt holds.

    ``--prompt-tokens``, at most what the window leaves beside the question, the template and
    the answer.
    """
    frame = engine.rag_segments(args.question, [])
    around = sum(len(engine.tokenize(segment.text)) for segment in frame if segment.text)
    window = engine.context_window
    if not window:
        return int(args.prompt_tokens)
    room = window - args.max_new_tokens - around - 2 * PER_DOCUMENT_TOKENS
    return max(1, min(args.prompt_tokens, room))


def _prompt_documents(
    args: argparse.Namespace, engine: BlendEngine, units: list[tuple[str, str]], budget: int
) -> list[tuple[str, str]]:
    """Return the ``(name, text)`` documents of ``ask``'s prompt: all that fit, else retrieved.

    ``budget``: document tokens the prompt holds (`_prompt_budget`). Says on stderr which
    documents the prompt holds when they are retrieved.
    """
    from kvblend.cli.precompute import prompt_tokens
    from kvblend.cli.retrieval import choose, rank

    tokens = [prompt_tokens(engine, text) for _, text in units]
    per_document = PER_DOCUMENT_TOKENS
    if sum(tokens) + per_document * len(units) <= budget:
        return units
    try:
        ranking = rank(args.question, [text for _, text in units], args.retriever)
    except ValueError as error:
        raise CLIError(str(error)) from None
    padded = [count + per_document for count in tokens]
    chosen = choose(ranking.order, padded, budget, args.top_k)
    if not chosen:
        raise CLIError(
            f"no document fits the prompt's budget of {budget:,} tokens (--prompt-tokens; the "
            f"shortest has {min(tokens):,}); pass a smaller --chunk-tokens",
            status=1,
        )
    used = sum(tokens[index] for index in chosen)
    print(
        printable(
            f"retrieved {len(chosen)} of {plural(len(units), 'document')} for the question "
            f"({ranking.method}; {used:,} tokens): "
            + ", ".join(units[index][0] for index in chosen)
        ),
        file=sys.stderr,
    )
    return [units[index] for index in chosen]


def cmd_explain(args: argparse.Namespace) -> None:
    """Show which parts of a prompt would be reused, recomputed or computed, and why."""
    if args.file is not None:
        try:
            prompt = Path(args.file).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CLIError(f"cannot read prompt file {args.file}: {error}") from error
    elif args.prompt is not None:
        prompt = args.prompt
    else:
        raise CLIError("give the prompt text, or --file PATH")
    if not prompt.strip():
        raise CLIError(f"the prompt{' file ' + args.file if args.file else ''} is empty")
    files = DocumentFiles()
    named = _read(args.docs, files) if args.docs else []  # before the model loads
    engine = _engine(args)
    if named:
        fitting = fitting_documents(
            engine, named, chunk=args.chunk, files=files, chunk_tokens=args.chunk_tokens
        )
        precompute_each(engine, fitting, files, tally=_tally(args), progress=_progress(args))
        _check_kept(engine, files, fail=False)
    print(engine.explain(prompt, _config(args)))


def _print_stats(stats: Any, indent: str = "") -> None:
    print(f"{indent}entries: {stats.entries}")
    print(f"{indent}bytes: {stats.bytes:,} ({stats.bytes / 2**20:.1f} MiB)")
    print(f"{indent}hit rate: {stats.hit_rate:.0%} ({stats.hits} hits, {stats.misses} misses)")
    print(f"{indent}evictions: {stats.evictions}, corrupt entries dropped: {stats.corrupt_dropped}")
    for name, tier in stats.tiers.items():
        print(f"{indent}{name} tier:")
        _print_stats(tier, indent + "  ")


def cmd_model_folder(args: argparse.Namespace) -> None:
    """Print the local folder of the model (a GGUF file is converted once), e.g. for vLLM."""
    from kvblend.models.loading import model_folder

    print(model_folder(args.model))


def cmd_bench(args: argparse.Namespace) -> None:
    """Run the TTFT benchmark script."""
    from kvblend.bench import main as bench_main

    code = bench_main(args.bench_args)
    if code:
        raise SystemExit(code)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of the ``kvblend`` command."""
    parser = OneLineParser(
        prog="kvblend",
        description="Reuse the KV cache of documents wherever they land in a RAG prompt.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def _add_demo(sub: Subcommands) -> None:
    """Add ``demo``: the bundled sample corpus's questions, full vs blended."""
    demo = sub.add_parser(
        "demo", help="answer the bundled sample corpus's questions, full vs blended"
    )
    add_model_options(demo)
    add_blend_options(demo)
    demo.add_argument(
        "--questions", type=positive_int, default=6, help="how many questions (default 6)"
    )
    demo.add_argument("--seed", type=int, default=0, help="seed of the document shuffles")
    demo.set_defaults(func=cmd_demo)


def _add_precompute(sub: Subcommands) -> None:
    """Add ``precompute``: the KV of text files into the store."""
    pre = sub.add_parser("precompute", help="precompute the KV of text files into the store")
    add_model_options(pre)
    pre.add_argument(
        "paths",
        nargs="*",
        help="text files or folders (one document per file; hidden files and folders are skipped)",
    )
    pre.add_argument(
        "--samples", action="store_true", help="also the documents of the bundled sample corpus"
    )
    add_chunk_option(pre)
    pre.set_defaults(func=cmd_precompute)


def _add_ask(sub: Subcommands) -> None:
    """Add ``ask``: a question over documents, with blended prefill."""
    ask = sub.add_parser("ask", help="answer a question over documents with blended prefill")
    add_model_options(ask)
    add_blend_options(ask)
    ask.add_argument("question")
    ask.add_argument(
        "--docs",
        nargs="+",
        required=True,
        help="text files or folders: all in one prompt when they fit "
        "--prompt-tokens, else the --top-k most relevant to the question; "
        "a file longer than the model's window is split into chunks",
    )
    add_chunk_option(ask, always=True)
    ask.add_argument(
        "--prompt-tokens",
        type=positive_int,
        default=DEFAULT_PROMPT_TOKENS,
        metavar="N",
        help="document tokens one prompt holds at most (default %(default)s, at "
        "most what the model's window leaves)",
    )
    ask.add_argument(
        "-k",
        "--top-k",
        type=positive_int,
        default=DEFAULT_TOP_K,
        help="documents retrieved when they do not all fit (default %(default)s)",
    )
    ask.add_argument(
        "--retriever",
        choices=["auto", "embeddings", "bm25"],
        default="auto",
        help="how documents are ranked when they do not all fit: embeddings "
        "(all-MiniLM-L6-v2, the retrieval extra), bm25, or auto (embeddings "
        "where installed; default)",
    )
    ask.add_argument("--compare", action="store_true", help="also answer with full prefill")
    ask.set_defaults(func=cmd_ask)


def _add_explain(sub: Subcommands) -> None:
    """Add ``explain``: what a prompt would reuse, and why."""
    explain = sub.add_parser(
        "explain", help="show what a prompt would reuse from the store, and why (computes nothing)"
    )
    add_model_options(explain)
    add_blend_options(explain, decodes=False)
    explain.add_argument("prompt", nargs="?", help="the final prompt text")
    explain.add_argument("--file", help="read the prompt from this file instead")
    explain.add_argument("--docs", nargs="+", help="precompute these text files or folders first")
    add_chunk_option(explain)
    explain.set_defaults(func=cmd_explain)


def _add_model_folder(sub: Subcommands) -> None:
    """Add ``model-folder``: the model's local folder."""
    folder = sub.add_parser(
        "model-folder",
        help="print the model's local folder, a GGUF file converted once (e.g. for vllm serve)",
    )
    folder.add_argument("--model", help="model folder or GGUF file (default: bundled)")
    add_quiet_option(folder)
    folder.set_defaults(func=cmd_model_folder)


def _add_bench(sub: Subcommands) -> None:
    """Add ``bench``, listed: `main` hands its arguments to the bench's parser."""
    # `kvblend bench ...` is handed to the bench parser whole (see `main`); this entry lists it.
    sub.add_parser(
        "bench",
        help="benchmarks: ttft, quality, ingest, gpu, doc-context, redis-ttft ... "
        "(see docs/benchmarks.md)",
    )


#: The commands, in the order ``kvblend --help`` lists them.
SUBCOMMANDS: tuple[Callable[[Subcommands], None], ...] = (
    _add_demo,
    _add_precompute,
    _add_ask,
    _add_explain,
    add_store_parser,
    _add_model_folder,
    _add_bench,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvblend`` command."""
    logging.basicConfig(level=logging.WARNING, format="kvblend: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["bench"]:  # its own parser: `kvblend bench --help` is the bench's help
            args = argparse.Namespace(func=cmd_bench, bench_args=argv[1:])
        else:
            args = build_parser().parse_args(argv)
            _quiet_other_bars(args)
        _check_arguments(args)
        args.func(args)
    except (CLIError, FileNotFoundError, ValueError) as error:
        if isinstance(error, FileNotFoundError) and not _is_model_not_found(error):
            raise
        message = " ".join(str(error).split())  # one line, whatever the error holds
        print(printable(f"kvblend: error: {message}"), file=sys.stderr)
        return error.status if isinstance(error, CLIError) else 2
    except SystemExit as exit_:  # argparse: --help (0) or a one-line usage error (2)
        return exit_.code if isinstance(exit_.code, int) else 2
    except KeyboardInterrupt:
        return 130
    return 0


def _quiet_other_bars(args: argparse.Namespace) -> None:
    """Hide the libraries' own progress bars (a GGUF file's conversion) where kvblend's are.

    They are shown on a terminal unless ``--quiet``: ``TQDM_DISABLE`` is tqdm's default for a
    bar that does not choose (read when tqdm is imported, which this command has not done yet).
    """
    if getattr(args, "quiet", False) or not sys.stderr.isatty():
        os.environ.setdefault("TQDM_DISABLE", "1")


def _is_model_not_found(error: Exception) -> bool:
    """Whether ``error`` is the engine's `ModelNotFoundError` (a user mistake, one line)."""
    if "kvblend.engine" not in sys.modules:  # no model was looked for
        return False
    from kvblend.errors import ModelNotFoundError

    return isinstance(error, ModelNotFoundError)


if __name__ == "__main__":
    sys.exit(main())
