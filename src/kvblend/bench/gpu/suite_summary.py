"""The GPU suite's summary: the GPU targets checked against the suite's result files.

`summarize(folders, lengths)` reads what `suite.py` wrote into one or more folders (a later
folder's file replaces an earlier one's of the same name, so the results of two commands can be
summarized together) and returns the summary: one line per target, "target, measured, met / not
met / missing", then figures without a target (load time, the probe over a quarter of the
layers, the ratios from token ids and against ``generate``, decode from the static cache and
compiled, FlexAttention vs query chunks, the tests).

Every target is a TTFT over transformers' full prefill from the prompt string (its forward, the
tokenizer timed), as kvblend's TTFT is from the string; the blends' targets are checked with
the documents in each tier `kvblend bench gpu` times: the GPU's memory, host memory (pinned)
and a cold disk.

The field names are those of their writers: ``kvblend bench gpu``
(`kvblend.bench.gpu.figures.run_gpu`, its ``ttft.summary`` from
`kvblend.bench.speed.ttft_summary.summarize_ttft` and its ``transformers`` rows) and ``kvblend
bench decode`` (``meta``, ``rows``). Usage, without running anything::

    kvblend bench gpu-suite --summarize DIR [DIR ...] [--out DIR]
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: Result files of the bench runs, by the name the summary calls them.
RUNS = {"llama-8b": "gpu_llama8b.json", "qwen": "gpu_qwen.json"}
#: The compiled layer loop against the eager one (``STRATEGY@compiled`` rows beside each).
COMPILED = "gpu_compiled.json"
#: What ``scripts/gpu_run.sh`` writes of each phase it ran.
PHASES = "phases.txt"
#: Prompt lengths each run's targets are checked at.
TARGET_LENGTHS = {"llama-8b": (8192, 16384), "qwen": (8192,)}
#: (run, strategy, most TTFT / transformers' forward from text).
RATIO_TARGETS = (
    ("llama-8b", "default", 0.33),
    ("llama-8b", "reuse", 0.15),
    ("qwen", "default", 0.6),
    ("qwen", "reuse", 0.4),
)
FULL_WITHIN = 1.1  # kvblend's full prefill / transformers' forward
PROBE = "default+probe_layers=0.25"
#: Where the documents' KV is read from, as `kvblend.bench.speed.ttft` names the stores.
TIERS = ("memory", "host", "disk")
FORWARD = "transformers-forward-text"  # the baseline: from the prompt string


@dataclass
class Check:
    """One target: what it asks, what was measured, and whether it is met."""

    target: str
    measured: float | None
    status: str  # "met", "not met" or "missing"
    detail: str = ""

    def line(self) -> str:
        """Return the check as one line of the summary."""
        value = "-" if self.measured is None else f"{self.measured:.3f}"
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.target}, measured {value}, {self.status}{extra}"


def check(
    target: str, measured: float | None, limit: float, at_most: bool, why: str, label: str = ""
) -> Check:
    """Return a `Check` of ``measured`` against ``limit`` (``why``: why it may be None)."""
    if measured is None:
        return Check(target, None, "missing", why)
    met = measured <= limit if at_most else measured >= limit
    return Check(target, measured, "met" if met else "not met", label)


def load_folders(folders: Sequence[Path]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Every JSON result and the steps' records of ``folders``, a later folder's winning.

    ``results["target_lengths"]`` is the lengths a smoke run checks the targets at, if any.
    """
    results: dict[str, Any] = {"unreadable": []}
    steps: dict[str, dict[str, Any]] = {}
    for folder in folders:
        steps |= read_phases(folder / PHASES)
        for path in sorted(folder.glob("*.json")):
            if path.name == "summary.json":
                continue
            try:
                data = json.loads(path.read_text())
            except ValueError as error:  # cut short by its step's time limit
                results["unreadable"].append(f"{path.name}: unreadable ({error})")
                continue
            if path.name == "steps.json":
                steps |= {step["name"]: step for step in data["steps"]}
                if data.get("target_lengths"):
                    results["target_lengths"] = data["target_lengths"]
            else:
                results[path.name] = data
        for path in sorted(folder.glob("*.xml")):  # junit reports: tests.xml, compiled-tests.xml
            results[path.name] = path
    return results, steps


def read_phases(path: Path) -> dict[str, dict[str, Any]]:
    """Return the steps' records in ``scripts/gpu_run.sh``'s ``phases.txt`` (none: no file).

    One line per phase run: ``NAME rc=CODE SECONDSs limit LIMITs``; exit 124 or 137 is
    ``timeout``'s (the phase ran out of its limit and was stopped).
    """
    steps: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return steps
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) < 4 or not parts[1].startswith("rc=") or not parts[1][3:].isdigit():
            continue
        name, code = parts[0], int(parts[1][3:])
        seconds, limit = float(parts[2].rstrip("s")), parts[-1].rstrip("s")
        if code == 0:
            status = "ok"
        elif code in (124, 137):
            status = f"timed out after {limit} s"
        else:
            status = f"failed (exit {code}, see {name}.log)"
        steps[name] = {"name": name, "status": status, "seconds": seconds, "log": f"{name}.log"}
    return steps


def _why_missing(steps: dict[str, dict[str, Any]], step: str, file: str) -> str:
    record = steps.get(step)
    if record is None:
        return f"step {step} not run: no {file}"
    return f"step {step}: {record['status']}"


class Run:
    """One ``kvblend bench gpu`` result: its summary rows (by tier) and transformers' rows."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data
        self.tiers = {
            (s["target_tokens"], s["strategy"], s["store"]): s for s in data["ttft"]["summary"]
        }
        self.rows = {
            (length, name): s
            for (length, name, store), s in self.tiers.items()
            if store == "memory"
        }
        self.baseline = {(r["target_tokens"], r["run"]): r for r in data["transformers"]}

    def label(self) -> str:
        """Return what the run measured: the model, the device, the dtype."""
        machine = self.data.get("machine", {})
        model = self.data.get("model_shape")
        model = f"{model} random weights" if model else machine.get("model", "?")
        return f"{model}, {machine.get('device', '?')}, {machine.get('dtype', '?')}"

    def forward(self, length: int, run: str = FORWARD) -> float | None:
        """Return transformers' median TTFT of ``run`` at ``length`` (None: not measured)."""
        row = self.baseline.get((length, run))
        return row["ttft_median_s"] if row else None

    def over_forward(
        self, length: int, strategy: str, tier: str = "memory", run: str = FORWARD
    ) -> float | None:
        """Median TTFT of ``strategy`` (from text, documents in ``tier``) over ``run``'s."""
        row, forward = self.tiers.get((length, strategy, tier)), self.forward(length, run)
        return row["ttft_median_s"] / forward if row and forward else None

    def from_ids(self, length: int, strategy: str) -> float | None:
        """Both sides from token ids: the TTFT less its prompt handling over the forward's."""
        row, forward = (
            self.rows.get((length, strategy)),
            self.forward(length, "transformers-forward"),
        )
        value = row.get("ttft_from_ids_median_s") if row else None
        return value / forward if value is not None and forward else None

    def decode_over_generate(self, length: int) -> float | None:
        """Decode tokens/s after the default's prefill over ``generate``'s, or None."""
        ours = self.rows.get((length, "default"), {}).get("decode_tok_s_median")
        theirs = self.baseline.get((length, "transformers-decode"), {}).get("decode_tok_s_median")
        return ours / theirs if ours and theirs else None


def run_checks(
    runs: dict[str, Run | None],
    why: dict[str, str],
    lengths: dict[str, Sequence[int]],
    tiers: Sequence[str] = TIERS,
) -> list[Check]:
    """Every target that a bench run answers, in ``tiers``."""
    checks = []
    for name, strategy, limit in RATIO_TARGETS:
        run = runs[name]
        for length in lengths[name]:
            for tier in tiers:
                where = "" if tier == "memory" else f", documents in the {tier} tier"
                target = (
                    f"{name} {_k(length)}: {strategy} <= {limit} x transformers' forward{where}"
                )
                value = run.over_forward(length, strategy, tier) if run else None
                missing = (
                    why[name]
                    if run is None
                    else f"no {strategy} ({tier}) or forward row at {length}"
                )
                label = run.label() if run else ""
                checks.append(check(target, value, limit, True, missing, label))
    for name in RUNS:
        for length in lengths[name]:
            run = runs[name]
            missing = why[name] if run is None else f"no row at {length} tokens"
            label = run.label() if run else ""
            target = f"{name} {_k(length)}: kvblend full <= {FULL_WITHIN} x transformers' forward"
            value = run.over_forward(length, "full") if run else None
            checks.append(check(target, value, FULL_WITHIN, True, missing, label))
            target = f"{name} {_k(length)}: decode after the default >= 1.0 x generate's tok/s"
            value = run.decode_over_generate(length) if run else None
            checks.append(check(target, value, 1.0, False, missing + " (decode tok/s)", label))
    order = list(RUNS)
    return sorted(checks, key=lambda c: order.index(c.target.split()[0]))


def _k(length: int) -> str:
    return f"{length / 1024:g}K"


def run_figures(runs: dict[str, Run | None], lengths: dict[str, Sequence[int]]) -> list[str]:
    """Figures without a target: load time, the probe, from ids, vs generate, peak memory."""
    lines = []
    for name, run in runs.items():
        if run is None:
            continue
        peak = run.data.get("peak_gpu_mib")
        lines.append(
            f"{name} ({run.label()}): peak GPU memory of the run "
            + (f"{peak:.0f} MiB" if peak is not None else "n/a")
        )
        for length in lengths[name]:
            lines += _baseline_figures(name, run, length)
            for strategy in ("default", PROBE, "reuse", "cacheblend-value-0.15"):
                row = run.rows.get((length, strategy))
                if row is None:
                    continue
                ratio = run.over_forward(length, strategy)
                share = row["load_s_median"] / row["ttft_median_s"]
                lines.append(
                    f"{name} {_k(length)} {strategy}: TTFT {row['ttft_median_s']:.4f} s"
                    + (f" = {ratio:.3f} x forward" if ratio else "")
                    + f", load_s {row['load_s_median']:.4f} s ({share:.0%} of TTFT)"
                    + _device(row)
                )
    return lines


def _device(row: dict[str, Any]) -> str:
    """Return the device's own times of a summary row (CUDA events), and uncompiled calls."""
    text = ""
    if row.get("blend_device_s_median") is not None:
        text += f"; on the device: blend {row['blend_device_s_median']:.4f} s"
        if row.get("load_device_s_median") is not None:
            text += f", loads {row['load_device_s_median']:.4f} s"
    if row.get("uncompiled_calls"):
        text += f"; {row['uncompiled_calls']} calls uncompiled (a compile refused)"
    return text


def compiled_figures(results: dict[str, Any], steps: dict[str, dict[str, Any]]) -> list[str]:
    """Return the compiled layer loop against the eager one, and its compile time.

    From ``gpu_compiled.json``: each ``NAME@compiled`` row beside its ``NAME`` row of the same
    run (interleaved), and the compile: the compiled strategy's first (warm-up) TTFT, which
    compiled its graphs, less its median TTFT.
    """
    data = results.get(COMPILED)
    if data is None:
        return [f"compiled loop: {_why_missing(steps, 'compiled', COMPILED)}"]
    run = Run(data)
    first = {
        (w["target_tokens"], w["strategy"]): w["ttft_s"] for w in data["ttft"].get("warmup", [])
    }
    lines = [f"compiled loop ({run.label()}):"]
    for (length, name), row in sorted(run.rows.items()):
        if not name.endswith("@compiled"):
            continue
        eager = run.rows.get((length, name.removesuffix("@compiled")))
        line = f"compiled loop {_k(length)} {name}: TTFT {row['ttft_median_s']:.4f} s"
        if eager is not None:
            ratio = row["ttft_median_s"] / eager["ttft_median_s"]
            line += f" vs eager {eager['ttft_median_s']:.4f} s: compiled / eager {ratio:.2f}"
        if (length, name) in first:
            line += f"; compiling: {first[(length, name)] - row['ttft_median_s']:.1f} s"
        lines.append(line + _device(row))
    return lines


def _baseline_figures(name: str, run: Run, length: int) -> list[str]:
    """Return the TTFT ratios from token ids, and against ``generate`` from text, at ``length``."""
    text, ids = run.forward(length), run.forward(length, "transformers-forward")
    if text is None or ids is None:
        return [f"{name} {_k(length)}: no transformers rows from text and from ids"]
    lines = [
        f"{name} {_k(length)}: transformers forward {text:.4f} s from text, {ids:.4f} s "
        f"from ids (tokenizing: {text - ids:+.4f} s)"
    ]
    for strategy in ("full", "default", "reuse"):
        parts = []
        for label, value in (
            ("from ids", run.from_ids(length, strategy)),
            (
                "vs generate from text",
                run.over_forward(length, strategy, "memory", "transformers-generate-text"),
            ),
        ):
            if value is not None:
                parts.append(f"{label} {value:.3f}")
        if parts:
            lines.append(f"{name} {_k(length)} {strategy}: " + ", ".join(parts))
    return lines


def decode_figures(results: dict[str, Any], steps: dict[str, dict[str, Any]]) -> list[str]:
    """``kvblend bench decode``: static vs dynamic cache, and the compiled step vs not."""
    plain, compiled = results.get("decode.json"), results.get("decode_compiled.json")
    lines = []
    kinds = (("eager", plain, "decode"), ("compiled", compiled, "decode-compiled"))
    for label, data, step in kinds:
        if data is None:
            lines.append(f"decode ({label}): {_why_missing(steps, step, step + ' results')}")
            continue
        for row in data["rows"]:
            lines.append(
                f"decode ({label}, {data['meta']['model']}, compiled={data['meta']['compiled']}) "
                f"{row['prompt_tokens']} tokens: static {row['static_tok_s']:.1f} tok/s, dynamic "
                f"{row['dynamic_tok_s']:.1f} tok/s ({row['static_over_dynamic']:.2f}x)"
                + ("" if row.get("outputs_equal", True) else ", the caches' greedy tokens differ")
            )
    if plain and compiled:
        eager = {row["prompt_tokens"]: row["static_tok_s"] for row in plain["rows"]}
        for row in compiled["rows"]:
            if row["prompt_tokens"] in eager:
                gain = row["static_tok_s"] / eager[row["prompt_tokens"]]
                lines.append(f"decode {row['prompt_tokens']} tokens: compiled / eager {gain:.2f}x")
    return lines


def attention_figures(results: dict[str, Any], steps: dict[str, dict[str, Any]]) -> list[str]:
    """Return the default's TTFT with ``KVBLEND_ATTENTION=flex`` vs the query chunks."""
    found = {}
    for kind in ("chunks", "flex"):
        data = results.get(f"gpu_attention_{kind}.json")
        if data is None:
            return [f"attention ({kind}): {_why_missing(steps, 'attention-' + kind, 'results')}"]
        found[kind] = Run(data)
    lines = []
    for length, strategy in sorted(found["chunks"].rows):
        flex = found["flex"].rows.get((length, strategy))
        if strategy == "full" or flex is None:
            continue
        chunks = found["chunks"].rows[(length, strategy)]
        lines.append(
            f"attention {_k(length)} {strategy}: flex {flex['ttft_median_s']:.4f} s "
            f"({flex['ttft_vs_full']:.3f} x full) vs chunks {chunks['ttft_median_s']:.4f} s "
            f"({chunks['ttft_vs_full']:.3f} x full): flex / chunks "
            f"{flex['ttft_median_s'] / chunks['ttft_median_s']:.2f}"
        )
    return lines


def junit_figures(
    results: dict[str, Any], steps: dict[str, dict[str, Any]], step: str = "tests"
) -> list[str]:
    """Return the counts of the junit report of a tests step, and its failures' names."""
    path = results.get(f"{step}.xml")
    if path is None:
        return [f"{step}: {_why_missing(steps, step, step + '.xml')}"]
    try:
        root = ElementTree.parse(path).getroot()
    except ElementTree.ParseError as error:  # cut short by the step's time limit
        return [f"{step}: {path.name} unreadable ({error}); {_why_missing(steps, step, '')}"]
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {
        key: sum(int(s.get(key, 0)) for s in suites)
        for key in ("tests", "failures", "errors", "skipped")
    }
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = [
        f"{step} ({steps.get(step, {}).get('note', 'pytest')}): {passed} passed, "
        f"{counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped"
    ]
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            lines.append(f"  failed: {case.get('classname')}::{case.get('name')}")
    return lines


def summarize(
    folders: Sequence[Path],
    lengths: dict[str, Sequence[int]] | None = None,
    tiers: Sequence[str] = TIERS,
) -> dict[str, Any]:
    """Return the summary of the suite's results in ``folders`` (see the module's docstring).

    ``tiers``: where the documents are read from in the targets checked (the GPU run times the
    GPU's memory and host memory, no disk).
    """
    results, steps = load_folders(folders)
    lengths = dict(lengths or results.get("target_lengths") or TARGET_LENGTHS)
    runs = {name: Run(results[file]) if file in results else None for name, file in RUNS.items()}
    why = {name: _why_missing(steps, name, file) for name, file in RUNS.items()}
    checks = run_checks(runs, why, lengths, tiers)
    figures = run_figures(runs, lengths) + _step_figures(results, steps)
    return {
        "folders": [str(folder) for folder in folders],
        "smoke": {k: list(v) for k, v in lengths.items()}
        != {k: list(v) for k, v in TARGET_LENGTHS.items()},
        "target_lengths": lengths,
        "steps": list(steps.values()),
        "targets": [asdict(c) for c in checks],
        "figures": figures,
    }


def _step_figures(results: dict[str, Any], steps: dict[str, Any]) -> list[str]:
    """Return the figures of the steps that ran or were due: decode, attention, tests, compiled.

    Then a line for each result file that could not be read.
    """
    figures = []
    if {"decode.json", "decode_compiled.json"} & results.keys() or "decode" in steps:
        figures += decode_figures(results, steps)
    if any(name.startswith("gpu_attention_") for name in results) or "attention-flex" in steps:
        figures += attention_figures(results, steps)
    figures += junit_figures(results, steps)
    if COMPILED in results or "compiled" in steps:
        figures += compiled_figures(results, steps)
    if "compiled-tests.xml" in results or "compiled-tests" in steps:
        figures += junit_figures(results, steps, "compiled-tests")
    return figures + results["unreadable"]


def markdown(summary: dict[str, Any]) -> str:
    """``summary.md``: the steps, the targets (one line each), the other figures."""
    lines = ["# GPU suite summary", "", "| step | status | seconds | output |", "|---|---|---|---|"]
    for step in summary["steps"]:
        lines.append(
            f"| {step['name']} | {step['status']} | {step['seconds']:.0f} | {step.get('log', '')} |"
        )
    at = "; ".join(
        f"{name} at {', '.join(map(_k, v))}" for name, v in summary["target_lengths"].items()
    )
    lines += [
        "",
        "## GPU targets",
        "",
        f"Checked: {at}; TTFT from the prompt string over transformers' forward from the string.",
    ]
    if summary["smoke"]:
        lines[-1] += " A smoke run (other lengths than the targets'): its numbers mean nothing."
    lines.append("")
    lines += [f"- {Check(**c).line()}" for c in summary["targets"]]
    lines += ["", "## Other figures", ""] + [f"- {line}" for line in summary["figures"]]
    return "\n".join(lines) + "\n"


def write(summary: dict[str, Any], out: Path) -> str:
    """Write ``summary.json`` and ``summary.md`` into ``out``; return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    text = markdown(summary)
    (out / "summary.md").write_text(text)
    return text
