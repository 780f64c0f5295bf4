"""Markdown tables and matplotlib plots (PNG) from saved benchmark results."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from kvblend.bench.quality.qa_bench import quality_report, summarize
from kvblend.bench.speed.ttft_summary import ttft_table

_CORRECTION_SUFFIX = re.compile(r"-c[0-9.]+$")


def plot_ttft(result: dict[str, Any], path: Path) -> Path:
    """TTFT (median over repeats) vs prompt length, one line per strategy, memory store."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lines: dict[str, list[tuple[int, float, float, float]]] = {}
    for s in result["summary"]:
        if s["store"] == "memory":
            lines.setdefault(s["strategy"], []).append(
                (s["prompt_tokens"], s["ttft_median_s"], s["ttft_min_s"], s["ttft_max_s"])
            )
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # more strategies than the default colour cycle has colours
    colors = [plt.get_cmap("tab20")(i) for i in range(20)]
    for index, (name, points) in enumerate(lines.items()):
        points.sort()
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        err = [[p[1] - p[2] for p in points], [p[3] - p[1] for p in points]]
        ax.errorbar(
            xs,
            ys,
            yerr=err,
            marker="o",
            capsize=3,
            label=name,
            color=colors[index % len(colors)],
            linestyle="--" if name.startswith("cacheblend") else "-",
            linewidth=2.5 if name in ("full", "default") else 1.2,
        )
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s, median, bars: min-max)")
    ax.set_yscale("log")
    ax.set_title("Time to first token by strategy (documents in memory)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_quality(result: dict[str, Any], path: Path) -> Path:
    """Accuracy and mean KL vs recompute fraction; a line per selection method, other points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for prefix, label in (
        ("attention-", "attention, stale-KV correction"),
        ("cacheblend-value-", "cacheblend value (as published)"),
        ("cacheblend-key-", "cacheblend key (as published)"),
    ):
        points = _line_points(summary, prefix, result.get("default_config", ""))
        if points:
            left.plot([p[0] for p in points], [p[1] for p in points], "o-", label=label)
            right.plot([p[0] for p in points], [p[2] for p in points], "o-", label=label)
    for name, marker in (("default", "*"), ("reuse", "s"), ("epic", "^")):
        if name in summary:
            s = summary[name]
            left.plot(
                [s["recompute_fraction"]],
                [s["accuracy"]],
                marker,
                markersize=10 if name == "default" else 6,
                label=name,
            )
            right.plot([s["recompute_fraction"]], [s["kl_mean"]], marker, label=name)
    if "full" in summary:
        left.axhline(summary["full"]["accuracy"], color="black", linestyle="--", label="full")
    left.set_xlabel("recomputed fraction of moved tokens")
    left.set_ylabel("accuracy")
    left.set_title("QA accuracy")
    right.set_xlabel("recomputed fraction of moved tokens")
    right.set_ylabel("mean KL(full || strategy), nats")
    right.set_title("Fidelity to full prefill")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _line_points(
    summary: dict[str, Any], prefix: str, default_config: str
) -> list[tuple[float, float, float]]:
    """Return one selection method's points: (recomputed fraction, accuracy, mean KL), sorted.

    Its strategies named ``prefix...`` at one correction setting and one check layer, and the
    default when it is this method (a cacheblend key line never holds it).
    """
    default_strategy = (
        "default"
        if default_config.startswith(f"BlendConfig(strategy='{prefix.split('-')[0]}'")
        and prefix != "cacheblend-key-"
        else None
    )
    return sorted(
        (s["recompute_fraction"], s["accuracy"], s["kl_mean"])
        for name, s in summary.items()
        if (
            name.startswith(prefix)
            and not name.endswith(("-L2", "-L3"))
            and not _CORRECTION_SUFFIX.search(name)  # each line is one correction setting
        )
        or name == default_strategy
    )


def plot_closeness(results: list[dict[str, Any]], path: Path, *, head: str | None = None) -> Path:
    """Mean KL to full prefill against compute, a point per strategy, the rounding floor a line.

    ``results``: `kvblend bench nq` results; every strategy of their summaries (one head: the
    first, or ``head``) is a point at its mean compute and mean KL, with the KL's 95% interval,
    labelled with the result's model, k and passage titles (computed or cached); a result
    holding ``full@bf16-prefill`` rows draws the floor's mean KL and 8 times it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvblend.bench.strategies import FLOOR

    fig, ax = plt.subplots(figsize=(8, 7.5))
    floors: list[float] = []
    for result in results:
        summary = [s for s in result["summary"] if s["strategy"] != "full"]
        heads = list(dict.fromkeys(s.get("head") for s in summary))
        chosen = head if head in heads else heads[0] if heads else None
        ks = ",".join(str(k) for k in result.get("ks", []))
        titles = {"cached": "titles cached", "computed": "titles computed"}.get(
            result.get("labels", "computed"), ""
        )
        label = ", ".join(part for part in (result.get("model", "?"), f"k {ks}", titles) if part)
        for entry in summary:
            if entry.get("head") != chosen:
                continue
            if entry["strategy"] == FLOOR:
                floors.append(entry["kl_mean"])
                continue
            low, high = entry["kl_ci"]
            ax.errorbar(
                [entry["compute_fraction"]],
                [entry["kl_mean"]],
                yerr=[[entry["kl_mean"] - low], [high - entry["kl_mean"]]],
                marker="o",
                capsize=3,
                label=f"{entry['strategy']} ({label}, {chosen})",
            )
    for floor in floors:
        ax.axhline(floor, color="black", linestyle="--", linewidth=1)
        ax.axhline(8 * floor, color="grey", linestyle=":", linewidth=1)
    if floors:
        ax.plot([], [], color="black", linestyle="--", label="full prefill in bfloat16 (floor)")
        ax.plot([], [], color="grey", linestyle=":", label="8 x floor")
    ax.set_xlabel("compute (share of full prefill's token-layers)")
    ax.set_ylabel("mean KL(full || strategy) at the first answer token, nats")
    ax.set_yscale("log")
    ax.set_title("Closeness to full prefill against compute (NQ-open)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(ttft_path: Path, quality_path: Path, img_dir: Path) -> str:
    """Markdown of whichever result files exist, with their plots written under ``img_dir``."""
    parts = []
    if ttft_path.exists():
        ttft = json.loads(ttft_path.read_text())
        plot = plot_ttft(ttft, img_dir / "ttft_vs_length.png")
        parts += ["## TTFT", "", ttft_table(ttft["summary"]), "", f"![TTFT]({plot})", ""]
    if quality_path.exists():
        quality = json.loads(quality_path.read_text())
        if quality.get("rows"):  # per-question rows: every figure, agreement by type included
            quality["summary"] = summarize(quality["rows"])
        plot = plot_quality(quality, img_dir / "quality_vs_ratio.png")
        parts += [
            f"## Quality ({quality['questions']} questions)",
            "",
            quality_report(quality["summary"]),
            "",
            f"![quality]({plot})",
            "",
        ]
    return "\n".join(parts) if parts else "no results found"
