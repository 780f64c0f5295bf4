"""The TTFT benchmark's summary: its runs as medians per prompt length, strategy and store.

`summarize_ttft` turns the rows `kvblend.bench.speed.ttft.run_ttft` times (one per repeat, length,
strategy and store) into medians, with each run's TTFT as a share of two baselines of the same
repeat and length: plain transformers as users call it (the ``transformers`` row, when it was
timed: the user's baseline) and kvblend's own full prefill; the cold-disk (host) runs are also
compared with the same strategy's memory runs. `ttft_table` writes a summary as a Markdown table
whose columns name the baseline they divide by (the ``ttft``, ``figures`` and ``gpu`` benchmarks
and the report print it).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

#: The user's baseline's rows (`kvblend.bench.speed.ttft_baseline.STRATEGY`; named here, where
#: the summary needs no model).
BASELINE = "transformers"


def summarize_ttft(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median, min and max TTFT per (length, strategy, store) and median shares of the baselines.

    ``ttft_vs_full`` is the median of each run's TTFT over kvblend's full prefill's in the same
    repeat and length (``speedup_vs_full`` its inverse's median); ``ttft_vs_transformers`` and
    ``speedup_vs_transformers`` the same over plain transformers' run (the ``transformers`` row,
    store ``none``), None when it was not timed. The disk/memory (host/memory) ratio pairs each
    cold-disk (host) run with the same strategy's memory run. ``ttft_from_ids_median_s``: the
    TTFT less its prompt handling (``prompt_s``).
    """
    timed = [r for r in rows if r["store"] in ("memory", "host", "disk", "none")]
    full = _ttft_by_repeat(timed, "full", "memory")
    users = _ttft_by_repeat(timed, BASELINE, "none")
    memory = {
        (r["repeat"], r["target_tokens"], r["strategy"]): r["ttft_s"]
        for r in timed
        if r["store"] == "memory"
    }
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for r in timed:
        groups.setdefault((r["target_tokens"], r["strategy"], r["store"]), []).append(r)
    decode = _decode_rates(rows)
    out = []
    for (length, name, store), group in groups.items():
        entry = {
            "target_tokens": length,
            "prompt_tokens": group[0]["prompt_tokens"],
            "strategy": name,
            "store": store,
            "ratio": group[0]["ratio"],
            "runs": len(group),
            **_ttft_shares(group, full, users),
            "recompute_fraction": group[0]["recompute_fraction"],
            "compute_fraction": group[0]["compute_fraction"],
            **_phases(group),
        }
        if store in ("host", "disk"):
            entry[f"{store}_vs_memory"] = statistics.median(
                r["ttft_s"] / memory[(r["repeat"], length, name)] for r in group
            )
        if store == "memory" and (length, name) in decode:
            entry["decode_tok_s_median"] = statistics.median(decode[(length, name)])
        out.append(entry)
    return out


def _ttft_by_repeat(
    rows: Sequence[dict[str, Any]], strategy: str, store: str
) -> dict[tuple[int, int], float]:
    """Return the TTFT of ``strategy``'s run from ``store`` in each (repeat, length)."""
    return {
        (r["repeat"], r["target_tokens"]): r["ttft_s"]
        for r in rows
        if r["strategy"] == strategy and r["store"] == store
    }


def _decode_rates(rows: Sequence[dict[str, Any]]) -> dict[tuple[int, str], list[float]]:
    """Each (length, strategy)'s decode rates, tokens/s, of the runs that decoded."""
    decode: dict[tuple[int, str], list[float]] = {}
    for r in rows:
        if r["store"] == "decode" and r.get("decode_tok_s"):
            decode.setdefault((r["target_tokens"], r["strategy"]), []).append(r["decode_tok_s"])
    return decode


def _ttft_shares(
    group: Sequence[dict[str, Any]],
    full: dict[tuple[int, int], float],
    users: dict[tuple[int, int], float],
) -> dict[str, Any]:
    """Return a group's median, min and max TTFT and its medians over each repeat's baselines."""
    ttfts = [r["ttft_s"] for r in group]
    speedups = [full[(r["repeat"], r["target_tokens"])] / r["ttft_s"] for r in group]
    versus_users = [
        users[(r["repeat"], r["target_tokens"])] / r["ttft_s"]
        for r in group
        if (r["repeat"], r["target_tokens"]) in users
    ]
    return {
        "ttft_median_s": statistics.median(ttfts),
        "ttft_min_s": min(ttfts),
        "ttft_max_s": max(ttfts),
        "speedup_vs_full": statistics.median(speedups),
        "ttft_vs_full": statistics.median(1 / s for s in speedups),
        "speedup_vs_transformers": _median(versus_users),
        "ttft_vs_transformers": _median(1 / s for s in versus_users),
    }


def _phases(group: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Return a group's medians of peak memory, loading, device times and prompt handling."""
    return {
        "peak_mib_median": statistics.median(r["peak_mib"] for r in group),
        "load_s_median": statistics.median(r["load_s"] or 0.0 for r in group),
        "blend_device_s_median": _median(r.get("blend_device_s") for r in group),
        "load_device_s_median": _median(r.get("load_device_s") for r in group),
        "uncompiled_calls": max(r.get("uncompiled_calls") or 0 for r in group),
        "prompt_s_median": statistics.median(r.get("prompt_s") or 0.0 for r in group),
        "ttft_from_ids_median_s": statistics.median(
            r["ttft_s"] - (r.get("prompt_s") or 0.0) for r in group
        ),
    }


def ttft_table(summary: Sequence[dict[str, Any]]) -> str:
    """Markdown table of a TTFT summary; each ratio's column names the baseline it divides by.

    ``TTFT / transformers``: over plain transformers on the same text (empty when it was not
    timed); ``TTFT / kvblend full``: over kvblend's own full prefill; ``vs memory``: a cold-disk
    (host) run over the same strategy's run with the documents in memory.
    """
    lines = [
        "| prompt | strategy | store | TTFT median (min-max) | TTFT / transformers | "
        "TTFT / kvblend full | vs memory | recomputed (of moved) | peak mem | decode tok/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        versus = s.get(f"{s['store']}_vs_memory")
        users = s.get("ttft_vs_transformers")
        decode = s.get("decode_tok_s_median")
        lines.append(
            f"| {s['prompt_tokens']} | {s['strategy']} | {s['store']} | "
            f"{s['ttft_median_s']:.3f} s ({s['ttft_min_s']:.3f}-{s['ttft_max_s']:.3f}) | "
            f"{f'{users:.3f}' if users is not None else ''} | {s['ttft_vs_full']:.3f} | "
            f"{f'{versus:.2f}x' if versus is not None else ''} | "
            f"{s['recompute_fraction']:.1%} | {s['peak_mib_median']:.0f} MiB | "
            f"{f'{decode:.1f}' if decode else ''} |"
        )
    return "\n".join(lines)


def _median(values: Iterable[float | None]) -> float | None:
    """Median of the values measured (None when none was: the CPU has no device times)."""
    measured = [value for value in values if value is not None]
    return statistics.median(measured) if measured else None
