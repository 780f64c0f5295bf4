"""The start-up calibration: vLLM's forward and the blend loop timed on this machine.

A job of its own kind (`CalibrationJob`), run once by the worker side when its parity gate
passed, before any request: vLLM's own forward (the parity gate's, ``vllm_forward``) at
`CalibrationJob.tokens` prompt tokens, and the blend loop over synthetic prompts of moved
documents at `CalibrationJob.blends`, each blend after one of vLLM's forwards (while they last)
so that a change of load on a shared machine touches both alike, each `runs` times with the
shortest kept. The synthetic prompts are laid out as served RAG prompts are (`synthetic_plan`:
a short head and question around documents of up to `DOCUMENT_TOKENS` tokens), so the server's
strategy reuses the share of rows it reuses on them: a blend that recomputed every row (a
1,024-token prompt of small documents behind a long question, where the strategy's 256-row
floor covers every moved token) would teach the cost model full prefill's cost per row and
forecast every longer blend too slow. Four blends fix the cost model's four weights: ``full``
(every row computed), the server's strategy at two lengths, and ``reuse`` (the uncached rows
only: the cost of reading, moving and writing every row). The synthetic documents' random KV
lies in a memory store of its own, in the server's KV codec (the blend reads and decodes it as
it reads any store), and the blends write into the same free blocks the gate uses. The values
are random, only the time counts: each point runs twice and keeps the shorter time, or once
when its first run took longer than `CalibrationJob.long_run_s`. The points become the cost
model's prior (`admission.Calibrated`); docs/vllm.md has the calibration's measured duration.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvblend.blend.config import BlendConfig
from kvblend.documents.segment_kv import SegmentKV
from kvblend.prompt.plan import PlannedSpan, PrefillPlan, TokenKind
from kvblend.store import MemoryKVStore
from kvblend.vllm.admission import Calibrated
from kvblend.vllm.costs import blend_features, vllm_features
from kvblend.vllm.execution.blending import WorkerModel, blend_into_cache
from kvblend.vllm.requests import BlendJob, BlendOutcome

__all__ = ["CalibrationJob", "synthetic_plan"]

#: Most tokens of a synthetic moved document (served RAG documents: a few hundred tokens).
DOCUMENT_TOKENS = 512
#: Tokens of the synthetic prompt's head and of its question (computed).
EDGE_TOKENS = 32


@dataclass(frozen=True)
class CalibrationJob:
    """What the start-up calibration times (a few seconds, once).

    ``tokens``: prompt lengths of vLLM's forward (about 5 s on 2 CPU cores); ``blends``: prompt
    lengths of the blends and their strategies (None: the server's; about 4 s); ``runs``: runs
    of each, the shortest kept; ``long_run_s``: a point whose first run (vLLM's forward and
    the blend together) took longer is not run again, its noise being small beside it (a
    server in bfloat16 on a CPU without bfloat16 units took 6 minutes to calibrate with every
    point run twice).
    """

    tokens: tuple[int, ...] = (256, 1024, 2048)
    blends: tuple[tuple[int, str | None], ...] = (
        (512, "full"),
        (1024, None),
        (2048, None),
        (1536, "reuse"),
    )
    runs: int = 2
    long_run_s: float = 2.0

    @torch.inference_mode()
    def run(
        self,
        model: WorkerModel,
        vllm_forward: Callable[[list[int]], object],
        config: BlendConfig,
        threads: Callable[[bool], None] | None = None,
    ) -> Calibrated:
        """Time vLLM's forward and the blend loop; return the points.

        ``threads(blending)`` sets the CPU thread count of a blend (True) or of vLLM's forward
        (False), as the worker's slices do.
        """
        generator = torch.Generator().manual_seed(0)
        vocab = int(model.library.segment_kv.tokenizer.vocab_size)

        def ids(count: int) -> list[int]:
            return torch.randint(0, vocab, (count,), generator=generator).tolist()

        vllm_points, blend_points = [], []
        for number, (total, strategy) in enumerate(self.blends):
            count = self.tokens[number] if number < len(self.tokens) else 0
            token_ids = ids(count)
            chosen = config if strategy is None else BlendConfig(strategy)
            job, segment_kv = synthetic_job(model, ids(total), chosen, generator)
            forward_s, blend_s, rows = float("inf"), float("inf"), 0
            for run in range(self.runs):
                if run and (forward_s if count else 0.0) + blend_s > self.long_run_s:
                    break
                if count:
                    began = time.perf_counter()
                    vllm_forward(token_ids)
                    forward_s = min(forward_s, time.perf_counter() - began)
                outcome = BlendOutcome(job.request_id, total=total)
                if threads is not None:
                    threads(True)
                try:
                    began = time.perf_counter()
                    blend_into_cache(model, job, chosen, outcome, segment_kv=segment_kv)
                    blend_s = min(blend_s, time.perf_counter() - began)
                finally:
                    if threads is not None:
                        threads(False)
                rows = outcome.rows
            if count:
                vllm_points.append((vllm_features(count, 0).tolist(), forward_s))
            blend_points.append((blend_features(rows, total).tolist(), blend_s))
        return Calibrated(vllm_points, blend_points)


def synthetic_job(
    model: WorkerModel, token_ids: list[int], config: BlendConfig, generator: torch.Generator
) -> tuple[BlendJob, SegmentKV]:
    """Return a blend of ``token_ids`` (`synthetic_plan`) and the store of its documents' KV."""
    own = model.library.segment_kv  # entries of every KV head (each rank reads its own)
    shape, dtype, total = own.decoder.shape, own.kv_dtype, len(token_ids)
    segment_kv = own.over(MemoryKVStore())
    plan = synthetic_plan(token_ids)
    for span in plan.spans:
        size = span.end - span.start
        kv = torch.randn(
            shape.num_layers, 2, shape.num_kv_heads, size, shape.head_dim, generator=generator
        )
        key = segment_kv.entry_key([], span.cached_ids)
        segment_kv.store.put(key, own.codec.encode(kv.to(dtype)))  # in the server's codec
    blocks = list(range(1, 2 + total // model.block_size))  # free at start-up (the gate's)
    return BlendJob("kvblend-calibration", plan, config, 0, total - 1, blocks), segment_kv


def synthetic_plan(token_ids: list[int]) -> PrefillPlan:
    """Lay ``token_ids`` out as a served RAG prompt: head, moved documents, question.

    The head and the question (`EDGE_TOKENS` each, the question taking what the documents leave)
    are computed; between them lie as few documents of equal size as keep each at most
    `DOCUMENT_TOKENS` tokens (a 1,024-token prompt: two of 480).
    """
    total = len(token_ids)
    room = total - 2 * EDGE_TOKENS
    kinds = np.full(total, int(TokenKind.COMPUTE), dtype=np.int8)
    spans = []
    if room > 0:
        count = -(-room // DOCUMENT_TOKENS)
        size = room // count
        for start in range(EDGE_TOKENS, EDGE_TOKENS + count * size, size):
            kinds[start : start + size] = int(TokenKind.MOVED)
            cached = token_ids[start : start + size]
            spans.append(PlannedSpan(start, start + size, 0, TokenKind.MOVED, [], cached))
    return PrefillPlan(np.asarray(token_ids, dtype=np.int64), kinds, spans)
