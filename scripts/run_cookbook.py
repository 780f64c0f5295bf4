"""Execute every cookbook notebook on the bundled model and write its outputs back.

``python scripts/run_cookbook.py [NOTEBOOK ...]`` (default: all). The committed outputs are
then what the code prints; ``tests/docs/test_cookbook.py`` re-runs the notebooks and fails when a
cell tagged ``checked`` (a cell whose output holds no timing) prints anything else.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

COOKBOOK = Path(__file__).resolve().parent.parent / "cookbook"


def run(path: Path) -> None:
    """Execute ``path`` in its folder and overwrite it with the outputs."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(COOKBOOK)}},
    )  # fmt: skip
    client.execute()
    for cell in notebook.cells:  # execution metadata only adds noise to the diff
        cell.metadata.pop("execution", None)
    nbformat.write(notebook, path)
    print(f"wrote {path.name}")


def main(names: list[str]) -> int:
    """Run the named notebooks (all without names)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    paths = [COOKBOOK / name for name in names] or sorted(COOKBOOK.glob("*.ipynb"))
    for path in paths:
        run(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
