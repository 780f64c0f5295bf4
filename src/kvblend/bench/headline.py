"""The figures tables of the README and the results page, written from the recorded results.

Every speed and quality figure the README states is a row of one table, and the results page
(docs/benchmarks.md) holds the current ones in its Speed and Quality tables; each is generated
from ``benchmarks/results/*.json`` by ``kvblend bench headline``: printed as Markdown, written
into a file between its markers (``--write README.md``, ``--write docs/benchmarks.md``), or
checked against them (``--check FILE``: exit status 1 when they differ;
``tests/bench/test_bench_headline.py`` runs the same check, so neither page can drift from the
results).

`TABLES` names the tables and `SPEED` and `QUALITY` list their rows; the README's `FIGURES` are
today's default's rows of both. Each `Figure` names a result file, which number in it (`kind`
and its selectors) and what the row is about; the rest comes from the result itself. To add a
row: record the result (``kvblend bench ... --output benchmarks/results/NAME.json``), add a
`Figure` to `SPEED` or `QUALITY`, run ``kvblend bench headline --write README.md`` and
``--write docs/benchmarks.md``.

Each row names its run: the date, the machine, the thread count and the model are the
result's own (the ``machine`` every bench command records). The command is the one the result
recorded (``command``), as a reader runs it from a clone (`reproducible_command`): without the
options that only say where files went (``--output``, ``--store-dir``, ``--work-dir``,
``--cache-dir``; a run writes into ``kvblend-bench/``), its data file read from
``benchmarks/data/`` (checked against the digest the result recorded); a result without a
command, or whose command names a file a clone does not have, cannot be a row. The setting of a
``default`` row is the default the result recorded (``default_config``, else the `Figure`'s),
compared with today's `BlendConfig()`: a row measured under an older default says what differed.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "BEGIN",
    "END",
    "FIGURES",
    "QUALITY",
    "SPEED",
    "TABLES",
    "Figure",
    "add_headline_arguments",
    "cmd_headline",
    "headline_table",
    "readme_table",
    "reproducible_command",
    "write_tables",
]

#: The README's markers around the generated table.
BEGIN = "<!-- figures:begin (written by `kvblend bench headline --write README.md`) -->"
END = "<!-- figures:end -->"

#: Where a clone keeps the data files the benchmarks read (``--data``).
DATA_DIR = Path(__file__).resolve().parents[3] / "benchmarks" / "data"


@dataclass(frozen=True)
class Figure:
    """One row of the README's figures table: which number of which recorded result.

    `kind` says how the number is read: ``"ttft"`` (TTFT of `strategy` as a share of plain
    transformers' when the result timed its ``transformers`` row, with kvblend's full prefill
    beside it, else of full prefill's, at `tokens` target tokens, documents in memory:
    ``kvblend bench ttft`` / ``figures`` / ``gpu``), ``"quality"`` (accuracy of `strategy` as
    a share of full prefill's, with its paired-bootstrap 95% interval and n: ``kvblend bench
    shapes``; `shape` None reads
    the pooled row, `head` the engine told the prompt head or not), ``"nq-quality"`` (the same
    from a ``kvblend bench nq`` run at `k` passages, with agreement with full prefill's answer,
    mean KL and compute beside it; `row` names the result's row when it is not `strategy`),
    ``"nq-closeness"`` (a ``kvblend bench nq --kl-only`` run: the first answer token's mean KL
    to full prefill's as a multiple of the rounding floor's, the first token's agreement
    beside the floor's, compute and n),
    ``"vllm-ttft"`` (vLLM with
    kvblend's TTFT as a share of vanilla vLLM's at `tokens`: ``kvblend bench vllm``) or
    ``"vllm-stall"`` (the streaming client's longest pause, as a share of vanilla's).
    `default_config` is for a result that did not record the default it ran; `note` is
    anything else the row must say.
    """

    what: str
    result: str
    kind: str
    strategy: str = "default"
    tokens: int | None = None
    shape: str | None = None
    head: str | None = None
    k: int | None = None
    row: str | None = None
    default_config: str | None = None
    note: str = ""


#: The CPU TTFT rows of today's default (the README's too).
_CPU_TTFT: tuple[Figure, ...] = (
    Figure(
        what="CPU TTFT, 1K-token RAG prompt (2 x 512-token documents)",
        result="ttft_default_1t.json",
        kind="ttft",
        tokens=1024,
        note="medians of 3 interleaved repeats",
    ),
    Figure(
        what="CPU TTFT, 4K-token RAG prompt (8 x 512-token documents)",
        result="ttft_default_1t.json",
        kind="ttft",
        tokens=4096,
        note="medians of 3 interleaved repeats",
    ),
)

#: The results page's Speed table, in order. Add rows here.
SPEED: tuple[Figure, ...] = (
    *_CPU_TTFT,
    Figure(
        what="vLLM TTFT, 4K-token RAG prompt, served in bfloat16",
        result="vllm_bf16.json",
        kind="vllm-ttft",
        tokens=4096,
        note="both servers' forwards on the same cores, prefix caching on; 1K-7.5K: 0.39-0.58",
    ),
    Figure(
        what="vLLM TTFT, 4K-token RAG prompt, served in float32",
        result="vllm_4k_regrouped.json",
        kind="vllm-ttft",
        tokens=4096,
        note="both servers' forwards on the same cores, prefix caching on; in float32 the "
        "blend's attention runs on SDPA's float32 kernel",
    ),
    Figure(
        what="vLLM stall: a streaming client's longest pause while three 4.2K-token prompts "
        "arrive, bfloat16",
        result="vllm_bf16.json",
        kind="vllm-stall",
        note="the three prompts answered in 0.49 of vanilla's time",
    ),
)

#: Today's default against full prefill on NQ-open's evaluation questions (the README's too).
_NQ_DEFAULT: tuple[Figure, ...] = (
    Figure(
        what="Answers on NQ-open evaluation questions, 10 retrieved passages (gold first, middle "
        "or last), documents cached behind the prompt's own head",
        result="nq_eval_default_smollm2.json",
        kind="nq-quality",
        head="told",
        k=10,
    ),
    Figure(
        what="The same, documents cached behind another head than the prompt's",
        result="nq_eval_default_smollm2.json",
        kind="nq-quality",
        head="untold",
        k=10,
    ),
    Figure(
        what="First answer token on NQ-open evaluation questions, 10 retrieved passages (gold "
        "first, middle or last), documents cached behind the prompt's own head",
        result="nq_eval_default_qwen0.5b_kl.json",
        kind="nq-closeness",
        head="told",
        k=10,
    ),
)

#: The results page's Quality table, in order. Add rows here.
QUALITY: tuple[Figure, ...] = (
    *_NQ_DEFAULT,
    Figure(
        what="First answer token on NQ-open evaluation questions, 10 retrieved passages, each "
        "passage's title cached with its text (what `BlendRetriever(document_prompt=...)` and "
        "LlamaIndex's node text give)",
        result="nq_eval_labels_cached_smollm2_kl.json",
        kind="nq-closeness",
        head="told",
        k=10,
    ),
    Figure(
        what="Answer accuracy, NQ-open evaluation questions, 10 retrieved passages (gold first, "
        "middle or last)",
        result="nq_eval_smollm2.json",
        kind="nq-quality",
        row="default+guard=inf",
        k=10,
        note="the default's answers with the guard's signals recorded (guard=inf never escalates)",
    ),
)

#: The README's figures table: today's default's rows of both (the results page has them all).
FIGURES: tuple[Figure, ...] = (*_CPU_TTFT, *SPEED[len(_CPU_TTFT) :], *_NQ_DEFAULT)

#: Every generated table by the name of its markers (``<!-- NAME:begin ... -->``).
TABLES: dict[str, tuple[Figure, ...]] = {"figures": FIGURES, "speed": SPEED, "quality": QUALITY}

_COLUMNS = ("figure", "measured", "setting", "model", "machine; threads", "date", "run")


class HeadlineError(Exception):
    """A `Figure` that its result file cannot answer (a missing file, strategy or length)."""


def _load(results: Path, name: str) -> dict[str, Any]:
    path = results / name
    try:
        loaded = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as error:
        raise HeadlineError(f"cannot read the recorded result {path}: {error}") from None
    if not isinstance(loaded, dict):
        raise HeadlineError(f"{path} does not hold a result (a JSON object)")
    return loaded


def _one(rows: Sequence[Mapping[str, Any]], figure: Figure, **match: Any) -> Mapping[str, Any]:  # noqa: ANN401
    found = [row for row in rows if all(row.get(key) == value for key, value in match.items())]
    if len(found) != 1:
        wanted = ", ".join(f"{key} {value}" for key, value in match.items())
        raise HeadlineError(f"{figure.result}: {len(found)} rows with {wanted}, expected one")
    return found[0]


def _ttft(result: Mapping[str, Any], figure: Figure) -> str:
    """Read the TTFT over the user's baseline (plain transformers) if timed, else over full's.

    A result with a ``transformers`` row (``kvblend bench ttft`` since it times one) is read
    against it, in the dtype both ran in, with kvblend's own full prefill beside it.
    """
    summary = result.get("summary") or (result.get("ttft") or {}).get("summary") or []
    row = _one(
        summary, figure, target_tokens=figure.tokens, strategy=figure.strategy, store="memory"
    )
    full = _one(summary, figure, target_tokens=figure.tokens, strategy="full", store="memory")
    if any(s.get("strategy") == "transformers" for s in summary):
        plain = _one(
            summary, figure, target_tokens=figure.tokens, strategy="transformers", store="none"
        )
        dtype = (result.get("machine") or {}).get("dtype", "the same dtype")
        return (
            f"**{row['ttft_vs_transformers']:.2f}** of plain transformers' TTFT in {dtype} "
            f"(`generate`, medians {row['ttft_median_s']:.2f} s vs {plain['ttft_median_s']:.2f} "
            f"s, {row['prompt_tokens']:,} tokens); {row['ttft_vs_full']:.2f} of kvblend's full "
            f"prefill's ({full['ttft_median_s']:.2f} s)"
        )
    return (
        f"**{row['ttft_vs_full']:.2f}** of full prefill's TTFT (medians "
        f"{row['ttft_median_s']:.2f} s vs {full['ttft_median_s']:.2f} s, "
        f"{row['prompt_tokens']:,} tokens)"
    )


def _quality(result: Mapping[str, Any], figure: Figure) -> str:
    rows = result.get("pooled", []) if figure.shape is None else result.get("summary", [])
    match: dict[str, Any] = {"strategy": figure.strategy, "shape": figure.shape or "all"}
    if figure.head is not None:
        match["head"] = figure.head
    row = _one(rows, figure, **match)
    low, high = row["share_of_full_ci"]
    return (
        f"**{row['share_of_full']:.0%}** of full prefill's accuracy (95% interval "
        f"{low:.0%}-{high:.0%}; {row['accuracy']:.1%} vs {row['full_accuracy']:.1%}), "
        f"n = {row['n']}"
    )


def _nq_row(
    result: Mapping[str, Any], figure: Figure, strategy: str | None = None
) -> Mapping[str, Any]:
    """Return the ``kvblend bench nq`` summary row of ``strategy`` (else the figure's row)."""
    match: dict[str, Any] = {"strategy": strategy or figure.row or figure.strategy}
    match["k"] = figure.k or 10
    if figure.head is not None:
        match["head"] = figure.head
    return _one(result.get("summary", []), figure, **match)


def _nq_quality(result: Mapping[str, Any], figure: Figure) -> str:
    row = _nq_row(result, figure)
    low, high = row["share_of_full_ci"]
    agree_low, agree_high = row["agreement_ci"]
    kl = f"{row['kl_mean']:.{3 if row['kl_mean'] >= 0.01 else 4}f}"
    return (
        f"**{row['share_of_full']:.0%}** of full prefill's accuracy (95% interval "
        f"{low:.0%}-{high:.0%}; {row['accuracy']:.1%} vs {row['full_accuracy']:.1%}); the same "
        f"answer as full prefill on {row['agreement']:.0%} ({agree_low:.0%}-{agree_high:.0%}), "
        f"mean KL {kl}{_of_floor(row)}, compute {row['compute_fraction']:.2f} of full's; "
        f"n = {row['n']}"
    )


def _nq_closeness(result: Mapping[str, Any], figure: Figure) -> str:
    from kvblend.bench.strategies import FLOOR

    row = _nq_row(result, figure)
    floor = _nq_row(result, figure, FLOOR)
    if row.get("kl_ratio") is None:
        raise HeadlineError(f"{figure.result}: no rounding floor ({FLOOR}) measured beside it")
    low, high = row["kl_ratio_ci"]
    top_low, top_high = row["agreement_first_token_ci"]
    kl = f"{row['kl_mean']:.{3 if row['kl_mean'] >= 0.01 else 4}f}"
    return (
        f"**{row['kl_ratio']:.1f}x** the first-token KL to full prefill that computing its "
        f"prefill in bfloat16 gives (95% interval {low:.1f}-{high:.1f}x; {kl} vs "
        f"{floor['kl_mean']:.4f}); the same first token as full prefill on "
        f"{row['agreement_first_token']:.1%} ({top_low:.1%}-{top_high:.1%}), the bfloat16 "
        f"prefill's {floor['agreement_first_token']:.1%}; compute {row['compute_fraction']:.2f} "
        f"of full's; n = {row['n']}"
    )


def _of_floor(row: Mapping[str, Any]) -> str:
    """`` (N x the rounding floor's, interval)`` when the run measured the floor beside it."""
    if row.get("kl_ratio") is None:
        return ""
    low, high = row["kl_ratio_ci"]
    return (
        f" ({row['kl_ratio']:.1f}x that of full prefill with its prefill in bfloat16, "
        f"{low:.1f}-{high:.1f}x)"
    )


def _vllm_ttft(result: Mapping[str, Any], figure: Figure) -> str:
    row = _one(result.get("summary", {}).get("ttft", []), figure, length=figure.tokens)
    return (
        f"**{row['ratio']:.2f}** of vanilla vLLM's TTFT ({row['kvblend_s']:.2f} s vs "
        f"{row['vanilla_s']:.2f} s, {row['prompt_tokens']:,} tokens)"
    )


def _vllm_stall(result: Mapping[str, Any], figure: Figure) -> str:
    try:
        pause = result["summary"]["stall"]["longest_pause_s"]
    except (KeyError, TypeError):
        raise HeadlineError(f"{figure.result}: no stall test in its summary") from None
    return (
        f"**{pause['ratio']:.2f}** of vanilla vLLM's pause ({pause['kvblend']:.2f} s vs "
        f"{pause['vanilla']:.2f} s)"
    )


_READERS: dict[str, Callable[[Mapping[str, Any], Figure], str]] = {
    "ttft": _ttft,
    "quality": _quality,
    "nq-quality": _nq_quality,
    "nq-closeness": _nq_closeness,
    "vllm-ttft": _vllm_ttft,
    "vllm-stall": _vllm_stall,
}

_CONFIG_ITEM = re.compile(r"(\w+)=('[^']*'|[^,)]+)")
#: Fields newer than some results whose value today does what versions without them did: at
#: these values they are no difference (``early_ratio`` is used only with ``early_layers``).
_AS_BEFORE = {
    "early_layers": "0.0",
    "probe_layers": "1.0",
    "probe_tail": "False",
    "guard": "None",
    "guard_signal": "shift",
    "stale_temperature": "1.0",
    "window": "1",
    "per_document": "0",
}


def config_fields(text: str) -> dict[str, str]:
    """Return the fields of a recorded ``BlendConfig(...)`` repr (any version's), as text."""
    fields = dict(_CONFIG_ITEM.findall(text))
    positional = re.match(r"BlendConfig\('(\w+)'", text)
    if positional:
        fields["strategy"] = f"'{positional.group(1)}'"
    return {name: value.strip("'") for name, value in fields.items()}


def _setting(result: Mapping[str, Any], figure: Figure) -> str:
    """Say what was measured; for the default, how it differs from today's `BlendConfig()`."""
    if figure.strategy != "default":
        return figure.strategy
    from kvblend.blend.config import BlendConfig

    recorded = result.get("default_config") or figure.default_config
    if recorded is None:
        raise HeadlineError(f"{figure.result}: no default_config recorded; give the Figure one")
    then, now = config_fields(str(recorded)), config_fields(repr(BlendConfig()))
    changed = [
        f"{name} {then[name]} (now {value})"
        for name, value in now.items()
        if name in then and then[name] != value
    ]
    missing = _missing_settings(then, now)
    if not changed and not missing:
        return "`BlendConfig()`, today's default"
    parts = changed + ([f"without {', '.join(missing)}"] if missing else [])
    return "an older default: " + "; ".join(parts)


def _missing_settings(then: dict[str, str], now: dict[str, str]) -> list[str]:
    """Today's settings a recorded default lacks, unless their value keeps what it did before."""
    unchanged = {name for name, value in _AS_BEFORE.items() if now.get(name) == value}
    if "early_layers" in unchanged:
        unchanged.add("early_ratio")
    return [
        f"{name} (now {value})"
        for name, value in now.items()
        if name not in then and name not in unchanged
    ]


_MODEL_SUFFIX = re.compile(r"(\.Q\d\w*)?(-[0-9a-f]{16})?(-v\d+)?$")


def _model(result: Mapping[str, Any]) -> str:
    machine = result.get("machine") or {}
    name = str(machine.get("model") or result.get("model") or "unknown")
    return _MODEL_SUFFIX.sub("", Path(name).name) or name


def _threads(result: Mapping[str, Any]) -> str:
    machine = result.get("machine") or {}
    if machine.get("torch_threads"):
        return str(machine["torch_threads"])
    cores, reserved = machine.get("cpu_count"), result.get("reserved_cpus")
    if cores and reserved is not None:
        return f"{cores - reserved} (vLLM's forward: {cores} cores less {reserved} reserved)"
    return "not recorded"


def _machine(result: Mapping[str, Any]) -> str:
    machine = result.get("machine") or {}
    if machine.get("gpu"):
        where = f"{machine['gpu']} ({machine.get('cpu_count', '?')} CPU cores)"
    else:
        arch = "x86_64" if "x86_64" in str(machine.get("platform", "")) else "CPU"
        where = f"{machine.get('cpu_count', '?')}-core {arch} CPU".replace(" CPU CPU", " CPU")
    load = result.get("load_average_at_start")
    busy = ", a core kept busy" if result.get("busy_core") else ""
    loaded = f", load {load[0]:.1f} at its start" if load else ""
    return f"{where}{busy}{loaded}; threads: {_threads(result)}"


def _git_date(results: Path, name: str) -> str:
    """Return the day of the last commit that changed ``name`` (it recorded the content)."""
    try:
        done = subprocess.run(
            ["git", "log", "-1", "--format=%ad", "--date=short", "--", name],
            cwd=results,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except OSError:
        return "not recorded (no git)"
    day = done.stdout.strip()
    return f"{day} (git)" if done.returncode == 0 and day else "not recorded (not in git)"


def _date(results: Path, result: Mapping[str, Any], figure: Figure) -> str:
    date = (result.get("machine") or {}).get("date")
    return str(date).split(" ")[0] if date else _git_date(results, figure.result)


#: Options that only say where a run's files go: a reader's run leaves them to their defaults
#: (results into ``kvblend-bench/``, documents' KV in memory or a temporary folder).
_PLACE_OPTIONS = ("--output", "--store-dir", "--work-dir", "--cache-dir")


def reproducible_command(command: str, data_sha256: str | None = None) -> str:
    """Return a recorded ``command`` as a reader runs it from the root of a clone.

    The options of `_PLACE_OPTIONS` are dropped; ``--data PATH`` becomes the file of that name
    in ``benchmarks/data/`` (whose SHA-256 must be ``data_sha256`` when the result recorded
    one). A command that still names a file outside the clone (an absolute path, ``..``) or
    is not a ``kvblend`` command is a `HeadlineError`.
    """
    import hashlib
    import shlex

    try:
        words = shlex.split(command)
    except ValueError as error:
        raise HeadlineError(f"cannot read the command {command!r}: {error}") from None
    if words[:1] != ["kvblend"]:
        raise HeadlineError(f"not a kvblend command a clone runs as written: {command!r}")
    kept: list[str] = []
    index = 0
    while index < len(words):
        word = words[index]
        name, _, inline = word.partition("=")
        value = inline if inline else (words[index + 1] if index + 1 < len(words) else "")
        step = 1 if inline else 2
        if name in _PLACE_OPTIONS:
            index += step
            continue
        if name == "--data":
            local = DATA_DIR / Path(value).name
            if not local.is_file():
                raise HeadlineError(f"{command!r} reads {value}, which benchmarks/data/ lacks")
            if data_sha256 and hashlib.sha256(local.read_bytes()).hexdigest() != data_sha256:
                raise HeadlineError(f"benchmarks/data/{local.name} is not the file {value} was")
            kept += ["--data", f"benchmarks/data/{local.name}"]
            index += step
            continue
        if word.startswith(("/", "~", "..")) or "/../" in word:
            raise HeadlineError(f"{command!r} names {word}, which a clone does not have")
        kept.append(word)
        index += 1
    return shlex.join(kept)


def _command(result: Mapping[str, Any], figure: Figure) -> str:
    command = result.get("command")
    if not command:
        raise HeadlineError(f"{figure.result}: no command recorded; it cannot be a row")
    return f"`{reproducible_command(str(command), result.get('data_sha256'))}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def headline_rows(
    results: Path, figures: Sequence[Figure] = FIGURES, link: str = "benchmarks/results/"
) -> list[list[str]]:
    """Return the table's cells, a list per `Figure`, read from the result files in ``results``.

    ``link``: the result files' folder as the page holding the table links it.
    """
    rows = []
    for figure in figures:
        reader = _READERS.get(figure.kind)
        if reader is None:
            raise HeadlineError(f"unknown kind {figure.kind!r} (one of {', '.join(_READERS)})")
        result = _load(results, figure.result)
        measured = reader(result, figure) + (f"; {figure.note}" if figure.note else "")
        run = f"{_command(result, figure)} ([{figure.result}]({link}{figure.result}))"
        rows.append(
            [
                figure.what,
                measured,
                _setting(result, figure),
                _model(result),
                _machine(result),
                _date(results, result, figure),
                run,
            ]
        )
    return rows


def headline_table(
    results: Path, figures: Sequence[Figure] = FIGURES, link: str = "benchmarks/results/"
) -> str:
    """Return a figures table (Markdown) from the recorded results in ``results``."""
    lines = [
        "| " + " | ".join(_COLUMNS) + " |",
        "|" + "---|" * len(_COLUMNS),
        *(
            "| " + " | ".join(_cell(cell) for cell in row) + " |"
            for row in headline_rows(results, figures, link)
        ),
    ]
    return "\n".join(lines)


def _markers(name: str) -> tuple[str, str]:
    if name == "figures":
        return BEGIN, END
    return (
        f"<!-- {name}:begin (written by `kvblend bench headline --write FILE`) -->",
        f"<!-- {name}:end -->",
    )


def write_tables(text: str, results: Path, page: Path) -> str:
    """Return ``text`` (the page at ``page``) with every table of `TABLES` it marks rewritten.

    The result files are linked relative to the page. A page that marks no table is a
    `HeadlineError`.
    """
    import os

    link = Path(os.path.relpath(results.resolve(), page.resolve().parent)).as_posix() + "/"
    found = False
    for name, figures in TABLES.items():
        begin, end = _markers(name)
        start, stop = text.find(begin), text.find(end)
        if start < 0 or stop < start:
            continue
        found = True
        table = headline_table(results, figures, link)
        text = text[: start + len(begin)] + "\n" + table + "\n" + text[stop:]
    if not found:
        raise HeadlineError(f"{page} marks no figures table (<!-- NAME:begin ... --> and end)")
    return text


def readme_table(text: str) -> tuple[int, int]:
    """Where the generated table lies in a README's ``text``: its start and end offsets."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise HeadlineError(f"the README has no figures table between {BEGIN!r} and {END!r}")
    return begin + len(BEGIN), end


def add_headline_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvblend bench headline``."""
    from kvblend.bench.result_files import RECORDED_DIR

    parser.add_argument(
        "--results",
        default=str(RECORDED_DIR),
        help="folder of the recorded results (default %(default)s)",
    )
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--write", metavar="README", help="replace the table between the README's markers"
    )
    where.add_argument(
        "--check", metavar="README", help="exit 1 when the README's table differs from the results"
    )


def cmd_headline(args: argparse.Namespace) -> None:
    """Print, write or check the figures tables of a page (the README, the results page)."""
    try:
        if args.write is None and args.check is None:
            print(headline_table(Path(args.results)))
            return
        path = Path(args.write or args.check)
        text = path.read_text("utf-8")
        wanted = write_tables(text, Path(args.results), path)
    except (HeadlineError, OSError) as error:
        print(f"kvblend bench headline: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.check is not None:
        if wanted != text:
            print(
                f"kvblend bench headline: {path}'s figures tables are not what {args.results} "
                f"gives; run kvblend bench headline --write {path}",
                file=sys.stderr,
            )
            raise SystemExit(1)
        print(f"{path}: the figures tables match {args.results}")
        return
    path.write_text(wanted, "utf-8")
    print(f"wrote the figures tables into {path}", file=sys.stderr)
