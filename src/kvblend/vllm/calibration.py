"""The start-up calibration: vLLM's forward and the blend loop timed on this machine.

A job of its own kind (`CalibrationJob`), run once by the worker side when its parity gate
passed, before any request: vLLM's own forward (the parity gate's, ``vllm_forward``) at
`CalibrationJob.tokens` prompt tokens, and the blend loop with the server's strategy over
synthetic prompts of moved documents (and with ``full``) at `CalibrationJob.blends`, one of
each in turn so that a change of load on a shared machine touches both alike, each `runs` times
with the shortest kept. The synthetic documents' random KV lies in a memory store of its own
(the blend reads it as it reads any store), and the blends write into the same free blocks the
gate uses. About 18 s on this project's 2 idle CPU cores; the values are random, only the time
counts. The points become the cost model's prior (`admission.Calibrated`).
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
from kvblend.prompt.segments import KV_NAME, segment_key
from kvblend.store import MemoryKVStore
from kvblend.vllm.admission import Calibrated
from kvblend.vllm.blending import WorkerModel, blend_into_cache
from kvblend.vllm.costs import blend_features, vllm_features
from kvblend.vllm.requests import BlendJob, BlendOutcome

__all__ = ["CalibrationJob"]

#: Tokens of each synthetic moved document.
DOCUMENT_TOKENS = 256


@dataclass(frozen=True)
class CalibrationJob:
    """What the start-up calibration times (a few seconds, once).

    ``tokens``: prompt lengths of vLLM's forward (about 5 s on 2 CPU cores); ``blends``: prompt
    lengths of the blends and their strategies (None: the server's; about 4 s); ``runs``: runs
    of each, the shortest kept.
    """

    tokens: tuple[int, ...] = (256, 1024, 2048)
    blends: tuple[tuple[int, str | None], ...] = ((384, "full"), (1024, None), (2048, None))
    runs: int = 2

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
        for count, (total, strategy) in zip(self.tokens, self.blends, strict=True):
            token_ids = ids(count)
            chosen = config if strategy is None else BlendConfig(strategy)
            job, segment_kv = synthetic_job(model, ids(total), chosen, generator)
            forward_s, blend_s, rows = float("inf"), float("inf"), 0
            for _ in range(self.runs):
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
            vllm_points.append((vllm_features(count, 0).tolist(), forward_s))
            blend_points.append((blend_features(rows, total).tolist(), blend_s))
        return Calibrated(vllm_points, blend_points)


def synthetic_job(
    model: WorkerModel, token_ids: list[int], config: BlendConfig, generator: torch.Generator
) -> tuple[BlendJob, SegmentKV]:
    """Return a blend of ``token_ids`` and the memory store of its documents' random KV.

    The prompt's head and question (32 tokens each at least) are computed; moved documents of
    `DOCUMENT_TOKENS` tokens lie between.
    """
    own = model.library.segment_kv  # entries of every KV head (each rank reads its own)
    shape, dtype, total = own.decoder.shape, own.kv_dtype, len(token_ids)
    segment_kv = SegmentKV(
        own.decoder, own.tokenizer, MemoryKVStore(), fingerprint=own.fingerprint,
        doc_prefix=None, kv_dtype=dtype, model_name=own.model_name,
        check_length=lambda tokens: None,
    )  # fmt: skip
    kinds = np.full(total, int(TokenKind.COMPUTE), dtype=np.int8)
    spans = []
    size = DOCUMENT_TOKENS
    for start in range(32, total - 32 - size + 1, size):
        kinds[start : start + size] = int(TokenKind.MOVED)
        cached = token_ids[start : start + size]
        spans.append(PlannedSpan(start, start + size, 0, TokenKind.MOVED, [], cached))
        kv = torch.randn(
            shape.num_layers, 2, shape.num_kv_heads, size, shape.head_dim, generator=generator
        )
        segment_kv.store.put(segment_key(own.fingerprint, [], cached), {KV_NAME: kv.to(dtype)})
    plan = PrefillPlan(np.asarray(token_ids, dtype=np.int64), kinds, spans)
    blocks = list(range(1, 2 + total // model.block_size))  # free at start-up (the gate's)
    return BlendJob("kvblend-calibration", plan, config, 0, total - 1, blocks), segment_kv
