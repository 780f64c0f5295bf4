"""A pytest plugin that keeps only the tests with a CUDA path: ``pytest -p cuda_only ...``.

The GPU runs' ``tests`` steps (``tests/`` on ``PYTHONPATH``, so that ``-p cuda_only`` finds it)
run the test files with CUDA paths (`kvblend.bench.gpu.suite.CUDA_TESTS`) with
``--device cuda``; their CPU-only tests ran on the CPU already, so on a GPU machine whose time
is short this keeps the tests that take the ``compute_device`` fixture (directly or through
``device_engine``), that are skipped without CUDA, or whose code names CUDA; the others are
deselected (pytest reports how many).
"""

from __future__ import annotations

import inspect

import pytest


def has_cuda_path(item: pytest.Item) -> bool:
    """Whether a collected test runs on the ``--device`` device or names CUDA."""
    if "compute_device" in getattr(item, "fixturenames", ()):
        return True
    for mark in item.iter_markers("skipif"):
        if "cuda" in str(mark.kwargs.get("reason", "")).lower():
            return True
    function = getattr(item, "function", None)
    try:
        source = inspect.getsource(function) if function is not None else ""
    except (OSError, TypeError):
        source = ""
    return "cuda" in source.lower()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the tests without a CUDA path."""
    kept = [item for item in items if has_cuda_path(item)]
    dropped = [item for item in items if not has_cuda_path(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
