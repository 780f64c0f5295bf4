"""Every strategy on the same prompt as full prefill, with engines told or not told the head.

The shape-agnostic half of the quality benchmarks: a `PromptItem` is a prompt as segments with
a scorer; `evaluate_item` prefills it with full prefill once, then with every other strategy on
each engine (engines share one model and differ in what documents are precomputed behind), and
records per row whether the answer is right, whether it equals full prefill's, KL(full ||
strategy) at the first answer position, the compute fraction and the TTFT. The strategies of
one question run back to back, so TTFT ratios compare runs taken under the same machine load.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvblend.bench.quality.qa_bench import STOP, kl_divergence
from kvblend.bench.quality.stats import strategy_stats
from kvblend.bench.strategies import Strategy
from kvblend.blend.config import BlendConfig
from kvblend.engine.engine import BlendEngine
from kvblend.engine.results import PrefillResult
from kvblend.prompt.segments import Segment

#: Engine heads: ``told`` precomputes documents behind the prompt's exact head; ``untold`` is an
#: engine left at its defaults (its own system prompt's RAG head), as a plain setup has it.
HEADS = ("told", "untold")


@dataclass
class PromptItem:
    """One question as a prompt: its segments, accepted answers and how an answer is scored."""

    qid: str
    segments: list[Segment]
    answers: list[str]
    score: Callable[[str], bool]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def head(self) -> str:
        """The prompt's prefix segment text (what a told engine precomputes behind)."""
        first = self.segments[0]
        if first.role != "prefix":
            raise ValueError(f"item {self.qid} has no prefix segment")
        return first.text

    @property
    def documents(self) -> list[str]:
        """The cached document texts of the prompt, in order."""
        return [s.text for s in self.segments if s.cache and s.role == "document"]


def engine_with_head(engine: BlendEngine, doc_prefix: str | None) -> BlendEngine:
    """Return another engine over ``engine``'s model and store, documents behind ``doc_prefix``.

    The store keys include the document context, so both engines can share the store.
    """
    return BlendEngine(
        engine.model,
        engine.tokenizer,
        store=engine.store,
        kv_dtype=engine.kv_dtype,
        system_prompt=engine.system_prompt,
        doc_prefix=doc_prefix,
        name=str(engine.name),
    )


def engines_for(base: BlendEngine, heads: Sequence[str], head_text: str) -> dict[str, BlendEngine]:
    """Return the engines by head name.

    ``told``: documents behind ``head_text``, the prompts' exact head; ``untold`` and ``bos``:
    ``base`` as loaded (its defaults, or BOS alone).
    """
    engines: dict[str, BlendEngine] = {}
    for head in heads:
        if head == "told":
            engines[head] = engine_with_head(base, head_text)
        elif head in ("untold", "bos"):
            engines[head] = base
        else:
            raise ValueError(f"unknown head {head!r}; use told, untold or bos")
    return engines


def _run(
    engine: BlendEngine, segments: list[Segment], config: BlendConfig, max_new_tokens: int
) -> tuple[Any, str, float]:
    pre = engine.prefill(segments, config)
    out = engine.generate(pre, max_new_tokens=max_new_tokens, stop=list(STOP))
    return pre, out.text.strip(), out.ttft_s + pre.stats.timings.get("prefill_s", 0.0)


def warm_up(engines: Mapping[str, BlendEngine], item: PromptItem) -> None:
    """Compute the prompt head's cache and warm the kernels before anything is timed."""
    for engine in engines.values():
        engine.precompute(item.documents, progress=False)
        engine.prefill(item.segments, BlendConfig("reuse"))


def evaluate_item(
    engines: Mapping[str, BlendEngine],
    item: PromptItem,
    strategies: Sequence[Strategy],
    *,
    max_new_tokens: int = 32,
) -> list[dict[str, Any]]:
    """Rows for ``item``: full prefill once, then every other strategy on every engine.

    ``strategies[0]`` must be ``full``; its row is repeated under every head (same numbers).
    Each engine's documents are precomputed before any prefill of the item is timed.
    """
    if not strategies or strategies[0].name != "full":
        raise ValueError("the first strategy must be 'full', the baseline")
    for engine in engines.values():
        engine.precompute(item.documents, progress=False)
    first = next(iter(engines.values()))
    full_pre, full_answer, full_ttft = _run(
        first, item.segments, strategies[0].config, max_new_tokens
    )
    base = {"qid": item.qid, **item.meta, "prompt_tokens": full_pre.stats.prompt_tokens}
    full = {
        "strategy": "full",
        "answer": full_answer,
        "correct": item.score(full_answer),
        "agrees": True,
        "kl": 0.0,
        "compute_fraction": 1.0,
        "recompute_fraction": 0.0,
        "documents_reused": 0,
        "reused_tokens": full_pre.stats.reused_tokens,
        "recomputed_tokens": 0,
        "fallback": None,
        "fallback_cause": None,
        "ttft_s": full_ttft,
        "ttft_ratio": 1.0,
    }
    rows: list[dict[str, Any]] = []
    for head, engine in engines.items():
        rows.append({**base, "head": head, **full})
        for strat in strategies[1:]:
            pre, answer, ttft = _run(
                engine, strat.segments(item.segments), strat.config, max_new_tokens
            )
            if pre.token_ids != full_pre.token_ids:
                raise RuntimeError(f"{strat.name} prefilled other token ids than full prefill")
            compared = _compared(item, pre, answer, full_pre, full_answer)
            rows.append(
                {
                    **base,
                    "head": head,
                    "strategy": strat.name,
                    "answer": answer,
                    **compared,
                    "ttft_s": ttft,
                    "ttft_ratio": ttft / full_ttft,
                }
            )
    return rows


def _compared(
    item: PromptItem, pre: PrefillResult, answer: str, full_pre: PrefillResult, full_answer: str
) -> dict[str, Any]:
    """Return a blend's answer and prefill against full prefill's: score, agreement, KL, counts."""
    return {
        "correct": item.score(answer),
        "agrees": answer == full_answer,
        "kl": kl_divergence(full_pre.logits, pre.logits),
        "compute_fraction": pre.stats.compute_fraction,
        "recompute_fraction": pre.stats.recompute_fraction,
        "documents_reused": pre.stats.documents_reused,
        "reused_tokens": pre.stats.reused_tokens,
        "recomputed_tokens": pre.stats.recomputed_tokens,
        "fallback": pre.stats.fallback,
        "fallback_cause": pre.stats.fallback_cause,
    }


def summarize_rows(
    rows: Sequence[dict[str, Any]], *, group_by: Sequence[str] = ("head",), seed: int = 0
) -> list[dict[str, Any]]:
    """Summarize each group (e.g. head) and strategy against full prefill.

    Paired statistics (`kvblend.bench.quality.stats`), mean compute fraction and the TTFT ratio
    (total strategy TTFT over total full-prefill TTFT on the same questions).
    """
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[key] for key in group_by), []).append(row)
    out = []
    for key, group in groups.items():
        paired = strategy_stats(group, seed=seed)
        full_ttft = sum(r["ttft_s"] for r in group if r["strategy"] == "full")
        for name, entry in paired.items():
            mine = [r for r in group if r["strategy"] == name]
            out.append(
                {
                    **dict(zip(group_by, key, strict=True)),
                    "strategy": name,
                    **entry,
                    "compute_fraction": statistics.fmean(r["compute_fraction"] for r in mine),
                    "recompute_fraction": statistics.fmean(r["recompute_fraction"] for r in mine),
                    "ttft_ratio": sum(r["ttft_s"] for r in mine) / full_ttft,
                    "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in mine),
                }
            )
    return out


def progress_line(rows: Sequence[dict[str, Any]]) -> str:
    """``told: full 40%, default 31% | untold: ...`` for a progress log."""
    parts: dict[str, list[str]] = {}
    counts: dict[tuple[str, str], list[bool]] = {}
    for row in rows:
        counts.setdefault((row["head"], row["strategy"]), []).append(bool(row["correct"]))
    for (head, name), marks in counts.items():
        parts.setdefault(head, []).append(f"{name} {sum(marks) / len(marks):.0%}")
    return " | ".join(f"{head}: {', '.join(items)}" for head, items in parts.items())


def elapsed(started: float) -> str:
    """Seconds since ``started``, for logs."""
    return f"{time.perf_counter() - started:.0f} s"


def run_items(
    engines: Mapping[str, BlendEngine],
    items: Sequence[PromptItem],
    strategies: Sequence[Strategy],
    *,
    max_new_tokens: int = 32,
    log: Callable[[str], None] | None = None,
    checkpoint: Callable[[list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """`evaluate_item` over every item; ``checkpoint(rows)`` every 10 items and at the end."""
    started = time.perf_counter()
    if items:
        warm_up(engines, items[0])
    rows: list[dict[str, Any]] = []
    for done, item in enumerate(items, start=1):
        rows += evaluate_item(engines, item, strategies, max_new_tokens=max_new_tokens)
        if done % 10 == 0 or done == len(items):
            if log is not None:
                log(f"[{done}/{len(items)} in {elapsed(started)}] {progress_line(rows)}")
            if checkpoint is not None:
                checkpoint(rows)
    return rows


def summary_table(summary: Sequence[dict[str, Any]], keys: Sequence[str] = ("head",)) -> str:
    """Markdown table of `summarize_rows` output, one row per group and strategy."""
    from kvblend.bench.quality.stats import format_ci

    head = " | ".join(keys)
    lines = [
        f"| {head} | strategy | n | accuracy | % of full [95% CI] | difference, points [95% CI] | "
        "mean KL [95% CI] | agreement with full | compute (of full) | TTFT (of full) |",
        "|" + "---|" * (len(keys) + 9),
    ]
    for s in summary:
        diff = s["difference_ci"]
        lines.append(
            "| " + " | ".join(str(s[key]) for key in keys) + f" | {s['strategy']} | {s['n']} | "
            f"{s['accuracy']:.1%} | {format_ci(s['share_of_full'], s['share_of_full_ci'])} | "
            f"{s['difference'] * 100:+.1f} [{diff[0] * 100:+.1f}, {diff[1] * 100:+.1f}] | "
            f"{format_ci(s['kl_mean'], s['kl_ci'], percent=False)} | {s['agreement']:.0%} | "
            f"{s['compute_fraction']:.2f} | {s['ttft_ratio']:.2f} |"
        )
    return "\n".join(lines)
