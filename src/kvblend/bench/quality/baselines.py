"""Full prefill's answers and first-token logits, kept on disk for later runs to reuse.

A quality benchmark compares every strategy with full prefill on the same prompt. Full prefill
is the most expensive row and does not depend on any blend setting, so its answer and its
next-token logits are kept per (model fingerprint, compute dtype, prompt token ids, decoding
options): a later run, a run with other strategies or another setting reads them instead of
computing them again. An entry is two files under ``<dir>/<key[:2]>/``: ``<key>.json`` (the
answer, the prompt length, the time it took, when, and the margins of the answer's first
tokens when they were recorded) and ``<key>.npy`` (the logits, float32).
Both are written to a temporary name and renamed, so a run stopped midway leaves no torn entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["Baseline", "BaselineCache", "default_baseline_dir"]


def default_baseline_dir() -> Path:
    """Where baselines are kept by default: the kvblend user cache folder, ``baselines/``."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvblend")) / "baselines"


@dataclass(frozen=True)
class Baseline:
    """Full prefill's greedy answer for one prompt and its next-token logits.

    ``margins``: the top-1 minus top-2 probability before each of the answer's first
    ``margin_steps`` tokens (fewer when the answer is shorter; None: not recorded).
    """

    answer: str
    logits: torch.Tensor  # [vocab] float32
    prompt_tokens: int
    ttft_s: float  # prefill and first token, when it was computed
    margins: list[float] | None = None
    margin_steps: int = 0


class BaselineCache:
    """Full prefill's answers on disk, keyed by model, dtype, prompt token ids and decoding."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_baseline_dir()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(fingerprint: str, dtype: str, token_ids: list[int], decoding: dict[str, Any]) -> str:
        """Return the entry's name: a sha256 of everything full prefill's answer depends on."""
        digest = hashlib.sha256()
        head = json.dumps(
            {"model": fingerprint, "dtype": dtype, "decoding": decoding}, sort_keys=True
        )
        digest.update(head.encode("utf-8"))
        digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
        return digest.hexdigest()

    def _paths(self, key: str) -> tuple[Path, Path]:
        folder = self.directory / key[:2]
        return folder / f"{key}.json", folder / f"{key}.npy"

    def get(self, key: str) -> Baseline | None:
        """Return the entry ``key``; None when it is absent or unreadable (then computed)."""
        meta_path, logits_path = self._paths(key)
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            logits = torch.from_numpy(np.load(logits_path))
        except (OSError, ValueError):
            self.misses += 1
            return None
        self.hits += 1
        return Baseline(
            meta["answer"],
            logits,
            int(meta["prompt_tokens"]),
            float(meta["ttft_s"]),
            meta.get("margins"),
            int(meta.get("margin_steps", 0)),
        )

    def put(self, key: str, baseline: Baseline) -> None:
        """Store ``baseline`` under ``key`` (atomically: a temporary file, then a rename)."""
        meta_path, logits_path = self._paths(key)
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        suffix = f".{os.getpid()}.tmp"
        logits_tmp = logits_path.with_name(logits_path.name + suffix)
        with logits_tmp.open("wb") as out:
            np.save(out, baseline.logits.detach().float().cpu().numpy())
        logits_tmp.replace(logits_path)
        meta = {
            "answer": baseline.answer,
            "prompt_tokens": baseline.prompt_tokens,
            "ttft_s": baseline.ttft_s,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        }
        if baseline.margins is not None:
            meta.update(margins=baseline.margins, margin_steps=baseline.margin_steps)
        meta_tmp = meta_path.with_name(meta_path.name + suffix)
        meta_tmp.write_text(json.dumps(meta), encoding="utf-8")
        meta_tmp.replace(meta_path)  # last: an entry with its json has its logits
