"""The sample corpus shipped with kvblend: eight short profiles and questions about them.

Used by ``kvblend demo``, the README and docs examples and the cookbook, so that every example
runs offline on the bundled model and has questions whose answers are known.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

__all__ = ["sample_corpus"]


def sample_corpus() -> dict[str, Any]:
    """Return the corpus as a dict.

    Keys: ``system`` (a system prompt), ``documents`` (each with ``title`` and ``text``) and
    ``questions`` (each with ``question`` and ``answer``).
    """
    text = (resources.files("kvblend") / "data" / "sample_corpus.json").read_text("utf-8")
    return dict(json.loads(text))
