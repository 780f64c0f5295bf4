r"""How often two `kvblend bench nq` runs give the same answer to the same questions.

Each run is a result file of ``kvblend bench nq`` and the strategy whose answers to take
(``FILE:STRATEGY``). The reference is usually full prefill; the other run, full prefill under
other numerics (``--dtype bf16``: the same model rounding every product to bfloat16), which puts
a floor under how far a blend's answers can be asked to follow full prefill's: a prefill whose
logits differ from full prefill's by a bfloat16 rounding already changes some answers.
Agreement is the benchmark's: normalised answers equal (`kvblend.bench.quality.nq`), and over
the first 1, 3 and 5 normalised words, with paired bootstrap 95% intervals over questions.

With ``--blend FILE:STRATEGY`` (a blend of the reference's run, e.g. ``default``): the blend's
agreement with the reference over every question, over the questions where the other run agrees
with the reference, and over those where it does not.

    python scripts/nq_agreement.py --reference nq_eval_smollm2.json:full \
        --other nq_full_smollm2_bf16.json:full --blend nq_eval_smollm2.json:default
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvblend.bench.quality.nq import normalize_answer

RESAMPLES = 2000


def answers(spec: str) -> tuple[str, dict[tuple[Any, Any], dict[str, Any]]]:
    """``FILE:STRATEGY`` -> (its label, its rows by (question id, k))."""
    path, _, name = spec.rpartition(":")
    if not path:
        raise SystemExit(f"{spec!r}: expected FILE:STRATEGY")
    with open(path, encoding="utf-8") as handle:
        result = json.load(handle)
    rows = {(row["qid"], row.get("k")): row for row in result["rows"]
            if row["strategy"] == name and row.get("answer") is not None}  # fmt: skip
    if not rows:
        raise SystemExit(f"{path}: no answered rows of strategy {name!r}")
    return f"{name} ({result.get('dtype', '?')}, {path})", rows


def same(first: str, second: str, words: int | None = None) -> bool:
    """Whether two answers agree once normalised (over their first ``words`` words if given)."""
    a, b = normalize_answer(first).split(), normalize_answer(second).split()
    return a[:words] == b[:words] if words else a == b


def interval(values: Sequence[float], seed: int = 0) -> tuple[float, float, float]:
    """Mean and bootstrap 95% interval of ``values``."""
    data = np.asarray(values, dtype=float)
    if not len(data):
        return float("nan"), float("nan"), float("nan")
    picks = np.random.default_rng(seed).integers(0, len(data), (RESAMPLES, len(data)))
    means = data[picks].mean(axis=1)
    return float(data.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def line(label: str, values: Sequence[float]) -> str:
    """``label: mean [low, high] (n = ...)``."""
    mean, low, high = interval(values)
    return f"{label}: {mean:.1%} [{low:.1%}, {high:.1%}] (n = {len(values)})"


def main() -> None:
    """Compare the runs; print the figures (and write them with ``--output``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--reference", required=True, help="FILE:STRATEGY, e.g. fp32.json:full")
    parser.add_argument("--other", required=True, help="FILE:STRATEGY, e.g. bf16.json:full")
    parser.add_argument("--blend", help="FILE:STRATEGY of a blend in the reference's run")
    parser.add_argument("--output", help="write the figures (json)")
    args = parser.parse_args()
    ref_label, reference = answers(args.reference)
    other_label, other = answers(args.other)
    keys = sorted(set(reference) & set(other), key=str)
    print(f"reference: {ref_label}\nother: {other_label}\nquestions in both: {len(keys)}")
    figures: dict[str, Any] = {"reference": args.reference, "other": args.other,
                               "questions": len(keys)}  # fmt: skip
    for words in (None, 1, 3, 5):
        values = [float(same(reference[k]["answer"], other[k]["answer"], words)) for k in keys]
        name = "whole answers" if words is None else f"first {words} words"
        print(line(f"other agrees with reference, {name}", values))
        figures[f"agreement_{words or 'whole'}"] = interval(values)
    for label, rows in (("reference", reference), ("other", other)):
        values = [float(bool(rows[k]["correct"])) for k in keys]
        print(line(f"accuracy of {label}", values))
        figures[f"accuracy_{label}"] = interval(values)
    if args.blend:
        blend_label, blend = answers(args.blend)
        print(f"blend: {blend_label}")
        both = [k for k in keys if k in blend]
        stable = [k for k in both if same(reference[k]["answer"], other[k]["answer"])]
        moved = [k for k in both if k not in set(stable)]
        for name, chosen in (("every question", both), ("other agrees", stable),
                             ("other differs", moved)):  # fmt: skip
            values = [float(same(reference[k]["answer"], blend[k]["answer"])) for k in chosen]
            print(line(f"blend agrees with reference, {name}", values))
            figures[f"blend_agreement_{name.replace(' ', '_')}"] = interval(values)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as handle:
            json.dump(figures, handle, indent=1)


if __name__ == "__main__":
    main()
