r"""Answer quality of every KV codec against full-precision entries, on the same prompts.

``kvblend bench codec-quality``: for each prompt shape (``nq-10``: NQ-open over ten retrieved
passages, ``qa``: the generated QA task, ``long``: NQ's top twelve passages joined into three long
documents; `kvblend.bench.quality.shapes`), one engine per codec (`kvblend.blend.kv_codec`), all
over one model and one store, every engine at its defaults (not told the prompts' head, as a plain
setup has it). Per question, full prefill runs once, then `BlendConfig()` (or ``--strategy``'s
blend) on each codec's engine (`kvblend.bench.quality.compare.evaluate_item`), so every codec is
paired with the same full prefill and with the full-precision entries' blend (codec ``none``) on
the same prompt.

Rows are appended to ``OUTPUT.rows.jsonl`` as each question ends; a run started again with the
same options skips the questions already there (resumable), and the summary ``OUTPUT`` is
rewritten every ten questions. Per shape and codec it reports accuracy, the paired difference
with full prefill and with the ``none`` blend (95% bootstrap intervals over questions), mean
KL(full || blend) at the first answer token and its paired difference with ``none``'s, and how
often the answer is word for word the ``none`` blend's.

    kvblend bench codec-quality --data nq_open_gold_2000.jsonl.gz --questions 300 \\
        --shapes nq-10,qa,long --codecs none,int8,k8v4,int4 --threads 1 [--model PATH] \\
        [--shard K/N]   # N processes, one per core, over one output
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvblend.bench.quality.compare import PromptItem, evaluate_item
from kvblend.bench.quality.nq import write_json
from kvblend.bench.quality.shapes import MAX_NEW_TOKENS, NQData, shape_items
from kvblend.bench.quality.stats import RESAMPLES, format_ci, paired_stats
from kvblend.bench.result_files import RESULTS_DIR
from kvblend.bench.strategies import strategy
from kvblend.blend.kv_codec import CODECS, kv_codec

SHAPES = ("nq-10", "qa", "long")
#: What "no worse than full-precision entries" allows in mean KL (nats).
KL_MARGIN = 0.005


def codec_engines(base: Any, codecs: Sequence[str]) -> dict[str, Any]:
    """One engine per codec over ``base``'s model, store and settings (``none``: ``base``)."""
    from kvblend.engine.engine import BlendEngine

    engines = {}
    for name in codecs:
        codec = kv_codec(name)
        engines[codec.name] = (
            base
            if codec == base.kv_codec
            else BlendEngine(
                base.model,
                base.tokenizer,
                store=base.store,
                kv_dtype=base.kv_dtype,
                system_prompt=base.system_prompt,
                doc_prefix=base.doc_prefix,
                name=str(base.name),
                kv_codec=codec,
                check_parity=False,
            )
        )
    return engines


def transcode(source: Any, engines: dict[str, Any], texts: Sequence[str]) -> int:
    """Store each text's entry for every codec's engine from ``source``'s full-precision one.

    What the codec's own precompute would store (the same K/V rows, encoded; precompute of
    the same batch computes the same rows), without computing every document once per codec.
    Returns the entries written.
    """
    source.precompute(list(texts), progress=False)
    written = 0
    for text in texts:
        key = source.segment_id(text)
        entry = source.store.get(key)
        if entry is None:
            continue
        kv, metadata = entry["kv"], dict(source.store.metadata(key) or {})
        for engine in engines.values():
            target = engine.segment_id(text)
            if engine is source or engine.store.contains(target):
                continue
            engine.store.put(
                target, engine.kv_codec.encode(kv), {**metadata, "codec": engine.kv_codec.name}
            )
            written += 1
    return written


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Return the rows a run (or an interrupted one) appended to ``path``, a cut line dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def _interval(samples: np.ndarray) -> list[float]:
    low, high = np.percentile(samples, [2.5, 97.5])
    return [float(low), float(high)]


def codec_summary(
    rows: Sequence[dict[str, Any]],
    baseline: str = "none",
    seed: int = 0,
    blend_strategy: str = "default",
) -> list[dict[str, Any]]:
    """Per shape and codec: paired statistics against full prefill and the ``baseline`` blend.

    Each codec's rows of ``blend_strategy`` are its blends. ``compute_mean`` and
    ``fallback_share`` say how much of each prompt the blends computed: a blend that recomputed
    every moved token (``fallback``) read only its reused head from the codec's entries.
    """
    out = []
    for shape in list(dict.fromkeys(row["shape"] for row in rows)):
        by: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        for row in rows:
            if row["shape"] == shape:
                by.setdefault((row["codec"], row["strategy"]), {})[row["qid"]] = row
        codecs = list(dict.fromkeys(codec for codec, _ in by))
        full = by.get((codecs[0], "full"), {})
        base = by.get((baseline, blend_strategy), {})
        for codec in codecs:
            blend = by.get((codec, blend_strategy), {})
            qids = [q for q in blend if q in full and q in base]
            if qids:
                paired = _Paired(qids, blend, full, base)
                out.append({"shape": shape, "codec": codec, **paired.summary(seed)})
    return out


class _Paired:
    """One codec's blends of a shape, each paired with full prefill's and the baseline blend's."""

    def __init__(
        self,
        qids: list[str],
        blend: dict[str, dict[str, Any]],
        full: dict[str, dict[str, Any]],
        base: dict[str, dict[str, Any]],
    ) -> None:
        self.qids, self.blend, self.full, self.base = qids, blend, full, base

    def column(self, rows: dict[str, dict[str, Any]], field: str) -> list[Any]:
        """Return ``field`` of each question's row in ``rows``."""
        return [rows[q][field] for q in self.qids]

    def summary(self, seed: int) -> dict[str, Any]:
        """Return the paired statistics against full prefill and against the baseline blend."""
        correct = self.column(self.blend, "correct")
        kl = np.array(self.column(self.blend, "kl"))
        base_kl = np.array(self.column(self.base, "kl"))
        vs_full = paired_stats(
            correct,
            self.column(self.full, "correct"),
            kl=kl.tolist(),
            agrees=self.column(self.blend, "agrees"),
            seed=seed,
        )
        answers = zip(
            self.column(self.blend, "answer"), self.column(self.base, "answer"), strict=True
        )
        same = [a == b for a, b in answers]
        vs_base = paired_stats(correct, self.column(self.base, "correct"), agrees=same, seed=seed)
        rng = np.random.default_rng(seed)
        index = rng.integers(0, len(self.qids), size=(RESAMPLES, len(self.qids)))
        base_correct = np.array(self.column(self.base, "correct"), dtype=float)
        base_ci = _interval(base_correct[index].mean(axis=1))
        kl_diff = float(kl.mean() - base_kl.mean())
        accuracy = vs_full["accuracy"]
        return {
            "n": len(self.qids),
            "full_accuracy": vs_full["full_accuracy"],
            "accuracy": accuracy,
            "difference_vs_full": vs_full["difference"],
            "difference_vs_full_ci": vs_full["difference_ci"],
            "none_accuracy": vs_base["full_accuracy"],
            "none_accuracy_ci": base_ci,
            "difference_vs_none": vs_base["difference"],
            "difference_vs_none_ci": vs_base["difference_ci"],
            "kl_mean": vs_full["kl_mean"],
            "kl_ci": vs_full["kl_ci"],
            "kl_vs_none": kl_diff,
            "kl_vs_none_ci": _interval((kl - base_kl)[index].mean(axis=1)),
            "agreement_with_full": vs_full["agreement"],
            "same_answer_as_none": vs_base["agreement"],
            "accuracy_within_none_ci": base_ci[0] <= accuracy <= base_ci[1],
            "kl_within_margin": kl_diff <= KL_MARGIN,
            "seconds_mean": statistics.fmean(self.column(self.blend, "ttft_s")),
            "compute_mean": statistics.fmean(self.column(self.blend, "compute_fraction")),
            "fallback_share": statistics.fmean(map(bool, self.column(self.blend, "fallback"))),
        }


def codec_table(summary: Sequence[dict[str, Any]]) -> str:
    """Markdown table of `codec_summary`."""
    lines = [
        "| shape | codec | n | full | blend accuracy | vs `none` blend, points [95% CI] | "
        "`none` accuracy [95% CI] | mean KL [95% CI] | KL vs `none` [95% CI] | "
        "same answer as `none` | compute | recomputed in full | met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        diff, ci = s["difference_vs_none"], s["difference_vs_none_ci"]
        low, high = s["none_accuracy_ci"]
        kl_low, kl_high = s["kl_vs_none_ci"]
        met = (
            "-"
            if s["codec"] == "none"
            else ("yes" if s["accuracy_within_none_ci"] and s["kl_within_margin"] else "no")
        )
        lines.append(
            f"| {s['shape']} | {s['codec']} | {s['n']} | {s['full_accuracy']:.1%} | "
            f"{s['accuracy']:.1%} | {diff * 100:+.1f} [{ci[0] * 100:+.1f}, {ci[1] * 100:+.1f}] | "
            f"{s['none_accuracy']:.1%} [{low * 100:.1f}, {high * 100:.1f}] | "
            f"{format_ci(s['kl_mean'], s['kl_ci'], percent=False)} | "
            f"{s['kl_vs_none']:+.4f} [{kl_low:+.4f}, {kl_high:+.4f}] | "
            f"{s['same_answer_as_none']:.0%} | {s['compute_mean']:.2f} | "
            f"{s['fallback_share']:.0%} | {met} |"
        )
    return "\n".join(lines)


def run_codec_quality(
    base: Any,
    shapes: Sequence[str],
    codecs: Sequence[str],
    *,
    data: str | Path | None,
    questions: int,
    output: Path,
    seed: int = 0,
    max_new_tokens: int = 32,
    log: Any = None,
    meta: dict[str, Any] | None = None,
    blend_strategy: str = "default",
    shard: tuple[int, int] = (0, 1),
) -> dict[str, Any]:
    """Run every codec on ``questions`` questions of each shape (resumable: ``*.rows.jsonl``).

    ``blend_strategy``: the blend every codec runs (a `kvblend.bench.strategies.strategy` name,
    such as ``default+min_recompute=0``); rows of another strategy in the rows file are kept
    and left out of this run's summary. ``shard`` ``(k, n)``: only the questions whose place in
    the shape's list is ``k`` modulo ``n``, so ``n`` processes (one per core) share a shape and
    one output; each appends its rows, and a last run without a shard finds them all done and
    writes the whole summary.
    """
    shard_index, shard_count = shard
    if not 0 <= shard_index < shard_count:
        raise ValueError(
            f"shard {shard_index}/{shard_count}: needs 0 <= {shard_index} < {shard_count}"
        )
    log = log or (lambda message: print(message, file=sys.stderr, flush=True))
    engines = codec_engines(base, ["none", *[c for c in codecs if kv_codec(c).name != "none"]])
    rows_path = output.with_suffix(".rows.jsonl")
    run = _CodecRun(engines, blend_strategy, rows_path, seed, log)
    nq = NQData(data, shapes="nq-10 and long")
    run.result = {
        "benchmark": "codec-quality",
        **(meta or {}),
        "data": str(data) if data else None,
        "questions_per_shape": questions,
        "seed": seed,
        "shapes": list(shapes),
        "codecs": list(engines),
        "strategy": blend_strategy,
        "kl_margin": KL_MARGIN,
        "rows_file": str(rows_path),
        "summary": [],
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    for shape in shapes:
        items: list[PromptItem] = shape_items(base, shape, questions, seed, nq)
        run.run_shape(shape, items, shard, MAX_NEW_TOKENS.get(shape, max_new_tokens), output)
    run.result["summary"] = codec_summary(run.rows, seed=seed, blend_strategy=blend_strategy)
    write_json(run.result, output)
    return run.result


class _CodecRun:
    """A codec-quality run: its engines and blend, its rows so far (those done), its result."""

    def __init__(
        self, engines: dict[str, Any], blend_strategy: str, rows_path: Path, seed: int, log: Any
    ) -> None:
        self.engines, self.blend_strategy, self.rows_path = engines, blend_strategy, rows_path
        self.strategies = [strategy("full"), strategy(blend_strategy)]
        self.seed, self.log = seed, log
        self.rows = read_rows(rows_path)
        self.done = {(r["shape"], r["qid"]) for r in self.rows if r["strategy"] == blend_strategy}
        self.result: dict[str, Any] = {}
        self.started = time.perf_counter()

    def run_shape(
        self,
        shape: str,
        items: list[PromptItem],
        shard: tuple[int, int],
        max_new_tokens: int,
        output: Path,
    ) -> None:
        """Run the shard's questions not done; write the summary every ten and at the end."""
        mine = [item for place, item in enumerate(items) if place % shard[1] == shard[0]]
        todo = [item for item in mine if (shape, item.qid) not in self.done]
        self.log(
            f"shape {shape}: {len(items)} questions, {len(mine)} in shard {shard[0]}/"
            f"{shard[1]}, {len(mine) - len(todo)} of them done before"
        )
        for count, item in enumerate(todo, start=1):
            began = time.perf_counter()
            self.rows += self.run_question(shape, item, max_new_tokens)
            if count % 10 == 0 or count == len(todo):
                self.result["summary"] = codec_summary(
                    self.rows, seed=self.seed, blend_strategy=self.blend_strategy
                )
                self.result["elapsed_s"] = time.perf_counter() - self.started
                write_json(self.result, output)
                line = ", ".join(
                    f"{s['codec']} {s['accuracy']:.0%}/{s['kl_mean']:.3f}"
                    for s in self.result["summary"]
                    if s["shape"] == shape
                )
                per = time.perf_counter() - began
                self.log(f"[{shape} {count}/{len(todo)}, {per:.1f} s per question] {line}")

    def run_question(
        self, shape: str, item: PromptItem, max_new_tokens: int
    ) -> list[dict[str, Any]]:
        """Run one question on every codec's engine; append its rows to the rows file."""
        began, cpu = time.perf_counter(), time.process_time()
        transcode(self.engines["none"], self.engines, item.documents)
        new = evaluate_item(self.engines, item, self.strategies, max_new_tokens=max_new_tokens)
        for row in new:
            row["shape"], row["codec"] = shape, row.pop("head")
        with self.rows_path.open("a") as file:
            file.writelines(json.dumps(row) + "\n" for row in new)
        self.log(
            f"{shape} {item.qid}: {time.perf_counter() - began:.1f} s, "
            f"{time.process_time() - cpu:.1f} s of CPU"
        )
        return new


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``kvblend bench codec-quality``."""
    from kvblend.bench.engines import load_engine
    from kvblend.bench.result_files import describe_machine, write_result
    from kvblend.blend.config import BlendConfig
    from kvblend.engine.engine import DEFAULT_SYSTEM_PROMPT

    args, shard, shapes = _arguments(argv)
    codecs = [kv_codec(c).name for c in args.codecs.split(",") if c.strip()]
    args.doc_prefix = "auto"
    base = load_engine(args, DEFAULT_SYSTEM_PROMPT)
    base.store.max_bytes = 1 << 30  # entries of earlier questions are evicted, not kept
    meta = {
        "machine": describe_machine(base),
        "default_config": repr(BlendConfig()),
        "max_new_tokens": args.max_new_tokens,
    }
    result = run_codec_quality(
        base,
        shapes,
        codecs,
        data=args.data,
        questions=args.questions,
        output=Path(args.output),
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        meta=meta,
        blend_strategy=args.strategy,
        shard=shard,
    )
    title = (
        f"KV codecs on {base.name}, {torch.get_num_threads()} thread(s), strategy "
        f"{args.strategy}, engine at its defaults"
    )
    write_result(result, Path(args.output), title + "\n\n" + codec_table(result["summary"]))


def _arguments(argv: list[str] | None) -> tuple[argparse.Namespace, tuple[int, int], list[str]]:
    """Parse ``kvblend bench codec-quality``'s options: the options, ``--shard``, the shapes."""
    parser = argparse.ArgumentParser(
        prog="kvblend bench codec-quality", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--model", help="model folder, GGUF file or hub id (default: bundled)")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--dtype",
        default="float32",
        help="auto, float32, bf16, fp16 (default float32: the exact "
        "reference the codecs' error is measured against)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", help="NQ jsonl(.gz) (the nq-10 and long shapes)")
    parser.add_argument(
        "--shapes", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES)
    )
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma list; none always runs")
    parser.add_argument("--questions", type=int, default=300, help="questions per shape")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument(
        "--strategy",
        default="default",
        help="the blend every codec runs, with +setting=value overrides (default: default)",
    )
    parser.add_argument(
        "--shard",
        default="0/1",
        help="K/N: only every N-th question from "
        "the K-th (0-based), to share a shape among N processes and one output",
    )
    parser.add_argument("--output", default=str(RESULTS_DIR / "codec_quality.json"))
    args = parser.parse_args(argv)
    try:
        shard = tuple(int(part) for part in args.shard.split("/"))
        if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
            raise ValueError
    except ValueError:
        parser.error(f"--shard {args.shard!r}: give K/N with 0 <= K < N, such as 1/2")
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; use {', '.join(SHAPES)}")
    return args, (shard[0], shard[1]), shapes
