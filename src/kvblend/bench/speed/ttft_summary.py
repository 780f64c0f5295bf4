"""The TTFT benchmark's summary: its runs as medians per prompt length, strategy and store.

`summarize_ttft` turns the rows `kvblend.bench.speed.ttft.run_ttft` times (one per repeat, length,
strategy and store) into medians, with each run's speedup against the full prefill of the same
repeat and length and the cold-disk (host) runs against the same strategy's memory runs;
`ttft_table` writes a summary as a Markdown table (the ``ttft``, ``figures`` and ``gpu``
benchmarks and the report print it).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any


def summarize_ttft(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median, min and max TTFT per (length, strategy, store) and median speedup vs full.

    The speedup of a run is full's TTFT in the same repeat and length divided by the run's TTFT;
    the disk/memory (host/memory) ratio pairs each cold-disk (host) run with the same strategy's
    memory run. ``ttft_from_ids_median_s``: the TTFT less its prompt handling (``prompt_s``).
    """
    timed = [r for r in rows if r["store"] in ("memory", "host", "disk")]
    full = {
        (r["repeat"], r["target_tokens"]): r["ttft_s"] for r in timed if r["strategy"] == "full"
    }
    memory = {
        (r["repeat"], r["target_tokens"], r["strategy"]): r["ttft_s"]
        for r in timed
        if r["store"] == "memory"
    }
    groups: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for r in timed:
        groups.setdefault((r["target_tokens"], r["strategy"], r["store"]), []).append(r)
    decode: dict[tuple[int, str], list[float]] = {}
    for r in rows:
        if r["store"] == "decode" and r.get("decode_tok_s"):
            decode.setdefault((r["target_tokens"], r["strategy"]), []).append(r["decode_tok_s"])
    out = []
    for (length, name, store), group in groups.items():
        ttfts = [r["ttft_s"] for r in group]
        speedups = [full[(r["repeat"], length)] / r["ttft_s"] for r in group]
        entry = {
            "target_tokens": length,
            "prompt_tokens": group[0]["prompt_tokens"],
            "strategy": name,
            "store": store,
            "ratio": group[0]["ratio"],
            "runs": len(group),
            "ttft_median_s": statistics.median(ttfts),
            "ttft_min_s": min(ttfts),
            "ttft_max_s": max(ttfts),
            "speedup_vs_full": statistics.median(speedups),
            "ttft_vs_full": statistics.median(1 / s for s in speedups),
            "recompute_fraction": group[0]["recompute_fraction"],
            "compute_fraction": group[0]["compute_fraction"],
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
        if store != "memory":
            entry[f"{store}_vs_memory"] = statistics.median(
                r["ttft_s"] / memory[(r["repeat"], length, name)] for r in group
            )
        if store == "memory" and (length, name) in decode:
            entry["decode_tok_s_median"] = statistics.median(decode[(length, name)])
        out.append(entry)
    return out


def ttft_table(summary: Sequence[dict[str, Any]]) -> str:
    """Markdown table of a TTFT summary."""
    lines = [
        "| prompt | strategy | store | TTFT median (min-max) | TTFT / full | speedup | "
        "recomputed (of moved) | peak mem | decode tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        versus = s.get(f"{s['store']}_vs_memory")
        extra = f"{versus:.2f}x memory" if versus is not None else ""
        decode = s.get("decode_tok_s_median")
        lines.append(
            f"| {s['prompt_tokens']} | {s['strategy']} | {s['store']} | "
            f"{s['ttft_median_s']:.3f} s ({s['ttft_min_s']:.3f}-{s['ttft_max_s']:.3f}) | "
            f"{s['ttft_vs_full']:.3f} | {s['speedup_vs_full']:.1f}x {extra} | "
            f"{s['recompute_fraction']:.1%} | {s['peak_mib_median']:.0f} MiB | "
            f"{f'{decode:.1f}' if decode else ''} |"
        )
    return "\n".join(lines)


def _median(values: Iterable[float | None]) -> float | None:
    """Median of the values measured (None when none was: the CPU has no device times)."""
    measured = [value for value in values if value is not None]
    return statistics.median(measured) if measured else None
