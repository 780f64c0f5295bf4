"""The figures tables of the README and the results page are what ``kvblend bench headline``
writes from the recorded results.

And every row names its run, with a command that runs as written from the root of a clone
(today's bench parser accepts it, its data file is in the clone and is the one the result
read); a row under an older default says so; a result recorded without its date takes it from
git and says so; ``kvblend bench`` never writes over the recorded results unless asked.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvblend.bench.cli import build_parser
from kvblend.bench.headline import (
    BEGIN,
    END,
    FIGURES,
    TABLES,
    Figure,
    HeadlineError,
    config_fields,
    headline_rows,
    headline_table,
    readme_table,
    reproducible_command,
    write_tables,
)
from kvblend.bench.result_files import RECORDED_DIR, RESULTS_DIR
from kvblend.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def test_the_readme_table_is_what_the_recorded_results_give() -> None:
    text = (ROOT / "README.md").read_text("utf-8")
    start, end = readme_table(text)
    assert text[start:end].strip() == headline_table(RESULTS), (
        "README.md's figures table differs from benchmarks/results: run "
        "`kvblend bench headline --write README.md`"
    )


def test_the_results_page_tables_are_what_the_recorded_results_give() -> None:
    page = ROOT / "docs" / "benchmarks.md"
    text = page.read_text("utf-8")
    for name in ("speed", "quality"):
        assert f"<!-- {name}:begin" in text and f"<!-- {name}:end -->" in text, name
    assert write_tables(text, RESULTS, page) == text, (
        "docs/benchmarks.md's tables differ from benchmarks/results: run "
        "`kvblend bench headline --write docs/benchmarks.md`"
    )
    assert "(../benchmarks/results/ttft_default_1t.json)" in text  # linked from the page's folder
    assert set(FIGURES) <= set(TABLES["speed"]) | set(TABLES["quality"])


def test_every_row_names_its_run() -> None:
    kinds = {figure.kind for figure in FIGURES}
    assert {"ttft", "nq-quality", "vllm-ttft", "vllm-stall"} <= kinds
    for figure, row in zip(FIGURES, headline_rows(RESULTS), strict=True):
        _, measured, setting, model, machine, date, run = row
        assert measured.startswith("**") and model and "threads: " in machine, row
        assert date[:4].isdigit() and run.startswith("`kvblend "), row
        assert f"(benchmarks/results/{figure.result})" in run
        if figure.kind in ("quality", "nq-quality", "nq-closeness"):
            assert "n = " in measured and "95% interval" in measured
            assert int(measured.split("n = ")[1].split(";")[0].split(",")[0]) >= 100, measured
        if figure.strategy == "default":
            assert "today's default" in setting or setting.startswith("an older default: ")


def test_every_rows_command_runs_as_written_from_a_clone() -> None:
    """Today's bench parser takes each row's command; a file it names is in the clone."""
    import shlex

    parser = build_parser()
    for row in headline_rows(RESULTS):
        command = row[6].split("`")[1]
        words = shlex.split(command)
        assert words[:2] == ["kvblend", "bench"], command
        for option in ("--output", "--store-dir", "--work-dir", "--cache-dir"):
            assert option not in words, command
        parser.parse_args(words[2:])  # exits (a failure) on an option the bench no longer has
        for word in words:
            if "/" in word and not word.startswith("-"):
                assert (ROOT / word).exists(), (command, word)


def test_a_recorded_command_becomes_the_one_a_clone_runs() -> None:
    recorded = (
        "kvblend bench nq --data /work/shared/data/nq_open_gold_2000.jsonl.gz --questions 5 "
        "--store-dir /tmp/w49/kv --output=nq.json"
    )
    assert reproducible_command(recorded) == (
        "kvblend bench nq --data benchmarks/data/nq_open_gold_2000.jsonl.gz --questions 5"
    )
    with pytest.raises(HeadlineError, match="is not the file"):
        reproducible_command(recorded, data_sha256="0" * 64)
    with pytest.raises(HeadlineError, match="which benchmarks/data/ lacks"):
        reproducible_command("kvblend bench nq --data /data/other.jsonl")
    with pytest.raises(HeadlineError, match="which a clone does not have"):
        reproducible_command("kvblend bench shapes --model /root/.cache/qwen.gguf")
    with pytest.raises(HeadlineError, match="not a kvblend command"):
        reproducible_command("python scripts/dtype_floor.py --questions 2")


def test_a_result_without_its_command_cannot_be_a_row() -> None:
    with pytest.raises(HeadlineError, match="no command recorded"):
        headline_rows(RESULTS, [Figure("x", "ttft_4k_final.json", "ttft", tokens=4096,
                                       default_config="BlendConfig()")])  # fmt: skip


def test_an_older_default_is_labelled_with_what_differed(tmp_path: Path) -> None:
    old = "BlendConfig(strategy='attention', recompute_ratio=0.4, check_layer=1, epic_tokens=16)"
    assert config_fields(old)["strategy"] == "attention"
    result = json.loads((RESULTS / "ttft_1k.json").read_text())
    result["default_config"] = old
    (tmp_path / "old.json").write_text(json.dumps(result))
    (row,) = headline_rows(tmp_path, [Figure("x", "old.json", "ttft", tokens=1024)])
    assert "recompute_ratio 0.4 (now 0.3)" in row[2] and "without min_recompute (now 256)" in row[2]
    assert "early_layers" not in row[2]  # at today's value it does what versions without it did


def test_a_date_not_recorded_comes_from_git_and_says_so(tmp_path: Path) -> None:
    result = json.loads((RESULTS / "vllm.json").read_text())
    del result["machine"]["date"]
    result["command"] = "kvblend bench vllm"
    (tmp_path / "old.json").write_text(json.dumps(result))
    env = {"GIT_AUTHOR_DATE": "2026-01-02T03:04:05Z", "GIT_COMMITTER_DATE": "2026-01-02T03:04:05Z"}
    commit = ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a run"]
    for command in (["init", "-q"], ["add", "old.json"], commit):
        subprocess.run(
            ["git", *command], cwd=tmp_path, check=True, env={**env, "PATH": "/usr/bin:/bin"}
        )
    figure = Figure("x", "old.json", "vllm-stall", default_config="BlendConfig()")
    (row,) = headline_rows(tmp_path, [figure])
    assert row[5] == "2026-01-02 (git)"
    assert "threads: 1 (vLLM's forward: 2 cores less 1 reserved)" in row[4]


def test_a_figure_its_result_cannot_answer_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(HeadlineError, match="0 rows with"):
        headline_rows(RESULTS, [Figure("x", "ttft_4k_final.json", "ttft", tokens=999)])
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{BEGIN}\n| stale |\n{END}\n")
    assert main(["bench", "headline", "--check", str(readme), "--results", str(RESULTS)]) == 1
    assert main(["bench", "headline", "--write", str(readme), "--results", str(RESULTS)]) == 0
    assert main(["bench", "headline", "--check", str(readme), "--results", str(RESULTS)]) == 0
    assert readme.read_text().startswith("# x\n\n" + BEGIN + "\n| figure |")


def test_bench_results_never_go_to_the_recorded_folder_by_default() -> None:
    assert RESULTS_DIR.resolve() != RECORDED_DIR.resolve()
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "ttft" in a.choices)
    checked = 0
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            if action.dest in ("output", "output_dir", "out") and action.default:
                assert not str(action.default).startswith(str(RECORDED_DIR)), (name, action)
                checked += 1
    assert checked >= 8
    from kvblend.bench.gpu import decode
    from kvblend.bench.gpu import suite as gpu_suite

    assert not str(decode.RESULTS_DIR).startswith(str(RECORDED_DIR))
    assert not str(gpu_suite.DEFAULT_OUT).startswith(str(RECORDED_DIR))


def test_a_ttft_row_is_read_against_the_users_baseline_when_it_was_timed(tmp_path: Path) -> None:
    def entry(strategy: str, store: str, median: float) -> dict[str, object]:
        return {"target_tokens": 4096, "prompt_tokens": 4170, "strategy": strategy,
                "store": store, "ttft_median_s": median, "ttft_vs_full": median / 2.0,
                "ttft_vs_transformers": median / 3.0}  # fmt: skip

    result = {
        "summary": [entry("transformers", "none", 3.0), entry("full", "memory", 2.0),
                    entry("default", "memory", 0.6)],
        "machine": {"model": "m", "dtype": "bfloat16", "torch_threads": 1, "date": "2026-12-01"},
        "command": "kvblend bench ttft", "default_config": "BlendConfig()",
    }  # fmt: skip
    (tmp_path / "t.json").write_text(json.dumps(result))
    (row,) = headline_rows(tmp_path, [Figure("x", "t.json", "ttft", tokens=4096)])
    assert row[1].startswith("**0.20** of plain transformers' TTFT in bfloat16 (`generate`, ")
    assert "medians 0.60 s vs 3.00 s" in row[1] and "0.30 of kvblend's full prefill's" in row[1]
    del result["summary"][0]  # a result without the row: read against full prefill
    (tmp_path / "t.json").write_text(json.dumps(result))
    (row,) = headline_rows(tmp_path, [Figure("x", "t.json", "ttft", tokens=4096)])
    assert row[1].startswith("**0.30** of full prefill's TTFT")


def test_a_first_token_run_is_read_against_the_rounding_floor(tmp_path: Path) -> None:
    def entry(strategy: str, kl: float, ratio: float | None, top1: float) -> dict[str, object]:
        return {"k": 10, "head": "told", "strategy": strategy, "n": 120, "kl_mean": kl,
                "kl_ratio": ratio, "kl_ratio_ci": [ratio * 0.8, ratio * 1.3] if ratio else None,
                "agreement_first_token": top1, "agreement_first_token_ci": [top1 - 0.04, top1],
                "compute_fraction": 0.4 if ratio != 1.0 else 1.0}  # fmt: skip

    result = {
        "summary": [entry("full", 0.0, None, 1.0), entry("full@bf16-prefill", 0.003, 1.0, 0.95),
                    entry("default", 0.0072, 2.4, 0.94)],
        "machine": {"model": "m", "dtype": "float32", "torch_threads": 1, "date": "2026-12-07"},
        "command": "kvblend bench nq --kl-only", "default_config": "BlendConfig()",
    }  # fmt: skip
    (tmp_path / "c.json").write_text(json.dumps(result))
    figure = Figure("x", "c.json", "nq-closeness", head="told", k=10)
    (row,) = headline_rows(tmp_path, [figure])
    assert row[1] == (
        "**2.4x** the first-token KL to full prefill that computing its prefill in bfloat16 "
        "gives (95% interval 1.9-3.1x; 0.0072 vs 0.0030); the same first token as full "
        "prefill on 94.0% (90.0%-94.0%), the bfloat16 prefill's 95.0%; compute 0.40 of full's; "
        "n = 120"
    )
    del result["summary"][1]  # no floor measured: not a row
    (tmp_path / "c.json").write_text(json.dumps(result))
    with pytest.raises(HeadlineError, match="0 rows with"):
        headline_rows(tmp_path, [figure])
