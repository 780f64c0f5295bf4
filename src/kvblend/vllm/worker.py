"""The connector's worker side: blend each claimed request before vLLM's forward, write its KV.

For every request the scheduler side claimed (`BlendJob`), ``start_load_kv`` runs the engine's
own blend loop (`kvblend.blend.loop.run_blend`) over the whole prompt, with the request's
`BlendConfig`, through `VLLMAdapter` (vLLM's loaded modules), and writes the rows vLLM did not
compute itself (``[start, stop)``) into its paged cache through the attention backend's own
cache-write op (`paged.write_rows`), layer by layer. vLLM's forward then computes the last
prompt token over that cache.

Faults never reach an answer: an entry that is missing or cannot be opened (damaged, of another
shape, a store outage) makes its rows computed by the blend in full, which is what vLLM would
compute; an entry that fails while being read is recomputed in place (`StoredRows`); a blend
that fails for any other reason is run again with strategy ``full`` (exact), and if even that
fails the claimed blocks are reported to vLLM as failed loads. Documents found but not stored
yet are computed and stored after the step's forward (``fill``), so the next prompt reuses them.

The parity gate runs when the KV caches are registered: the blend loop with strategy ``full``
against vLLM's own forward (`reference.vllm_logits`) on the engine's parity text. Its verdict
goes to the scheduler side, which claims nothing until it has one and nothing ever if it failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvblend.blend.config import BlendConfig
from kvblend.documents.blend_plan import blend_plan
from kvblend.documents.library import DocumentLibrary
from kvblend.documents.segment_kv import SegmentKV
from kvblend.engine.parity import PARITY_TEXT, parity_error, parity_tolerance
from kvblend.errors import BlendCancelledError
from kvblend.prompt.plan import PlannedSpan, PrefillPlan, TokenKind
from kvblend.prompt.segments import KV_NAME, segment_key
from kvblend.prompt.tokens import encode_prompt
from kvblend.store import MemoryKVStore
from kvblend.vllm.adapter import VLLMAdapter
from kvblend.vllm.paged import slot_mapping, write_rows

logger = logging.getLogger(__name__)

__all__ = ["BlendJob", "BlendOutcome", "WorkerSide"]


@dataclass
class BlendJob:
    """One request the scheduler side claimed: its plan and where its KV goes."""

    request_id: str
    plan: PrefillPlan
    config: BlendConfig
    start: int  # rows below are vLLM's own prefix-cache hit
    stop: int  # rows [start, stop) are written; vLLM computes the rest
    block_ids: list[int]


@dataclass
class BlendOutcome:
    """What the worker did with one job (sent back to the scheduler side)."""

    request_id: str
    reused: int = 0  # rows read from the store and not recomputed
    recomputed: int = 0
    lost: list[str] = field(default_factory=list)  # entries that could not be used, and why
    error: str | None = None  # why the blend ran as ``full`` (or failed)
    failed: bool = False  # nothing written: the blocks were reported as failed loads
    cancelled: bool = False  # the request was cancelled while its blend was under way
    blend_s: float = 0.0  # from the job's arrival to its end (slices and the steps between)
    compute_s: float = 0.0  # the blend's own time (its slices only)
    rows: int = 0  # rows computed, summed over the passes (the cost model's input)
    total: int = 0  # prompt tokens
    #: where the time went: reading entries, the blend loop (its probe pass apart), writing KV
    timings: dict[str, float] = field(default_factory=dict)


class Checkpoints:
    """The blend loop's ``cancel`` flag over a `pacing` checkpoint: each check may pause."""

    def __init__(self, checkpoint: Callable[[], None]) -> None:
        self.checkpoint = checkpoint

    def is_set(self) -> bool:
        """Pause here if the slice is spent (raises `BlendCancelledError` once cancelled)."""
        self.checkpoint()
        return False


def _no_pause() -> None:
    """Never pause (the checkpoint of a blend run in one go)."""


#: Prompt lengths of vLLM's forward the calibration times (about 5 s on 2 CPU cores)...
CALIBRATION_TOKENS = (256, 1024, 2048)
#: ... and of the blends, with their strategies (None: the server's; about 4 s).
CALIBRATION_BLENDS = ((384, "full"), (1024, None), (2048, None))
#: Runs of each, the shortest kept (about 18 s in all on 2 idle cores).
CALIBRATION_RUNS = 2


class WorkerSide:
    """Blends claimed requests into vLLM's paged cache in one worker process."""

    def __init__(self, adapter: VLLMAdapter, library: DocumentLibrary, block_size: int) -> None:
        self.adapter = adapter
        self.library = library
        self.block_size = block_size
        self.failed_blocks: set[int] = set()
        self.fill_refused = False  # said once: documents are not stored under tensor parallelism

    def gate(self, reference_logits: Any) -> tuple[bool, str]:
        """Run the parity gate; ``reference_logits(ids)`` is vLLM's own forward.

        Under tensor parallelism every rank computes the logits (vLLM gathers them to every
        rank on this platform) and the verdict is taken on the worst rank's error, so every
        rank reaches the same one.
        """
        ids = encode_prompt(self.library.segment_kv.tokenizer, PARITY_TEXT).ids.tolist()
        failed = None
        try:
            error = parity_error(self.adapter, reference_logits(ids), ids)
        except Exception as failure:  # noqa: BLE001 - any failure closes the gate
            error, failed = float("inf"), failure
        try:
            worst = float(self.adapter.gather_ranks(torch.tensor([error])).max())
        except Exception as failure:  # noqa: BLE001 - the ranks could not agree: closed
            return False, f"the parity gate could not compare the ranks' verdicts: {failure}"
        if failed is not None or worst == float("inf"):
            why = failed if failed is not None else "it failed on another tensor-parallel rank"
            return False, f"the parity gate could not run vLLM's forward: {why}"
        tolerance = parity_tolerance(self.adapter.dtype)
        if not worst <= tolerance:
            return False, (
                f"kvblend's layer loop does not reproduce vLLM's forward pass (relative logit "
                f"error {worst:.3g} > {tolerance:g}): refusing to blend"
            )
        return True, f"parity gate passed (relative logit error {worst:.3g})"

    @torch.inference_mode()
    def calibrate(
        self,
        vllm_forward: Callable[[list[int]], Any],
        config: BlendConfig,
        threads: Callable[[bool], None] | None = None,
    ) -> dict[str, list[tuple[list[float], float]]]:
        """Time vLLM's forward and the blend loop on synthetic prompts (the cost model's prior).

        vLLM's own forward (``vllm_forward(ids)``, the parity gate's) at `CALIBRATION_TOKENS`
        tokens; the blend loop with ``config`` (the server's strategy) over prompts of moved
        documents at `CALIBRATION_BLENDS` tokens, and with ``full``, its KV written into the
        same free blocks the gate uses. A few seconds, once, at start-up; the values are random
        (only the time counts). ``threads(blending)`` sets the CPU thread count of a blend
        (True) or of vLLM's forward (False), as the worker's slices do.
        """
        from kvblend.vllm.costs import blend_features, vllm_features

        generator = torch.Generator().manual_seed(0)
        vocab = int(self.library.segment_kv.tokenizer.vocab_size)

        def ids(count: int) -> list[int]:
            return torch.randint(0, vocab, (count,), generator=generator).tolist()

        vllm_points, blend_points = [], []
        for count, (total, strategy) in zip(CALIBRATION_TOKENS, CALIBRATION_BLENDS, strict=True):
            # one of each in turn, so a change of load on a shared machine touches both alike;
            # twice, the shorter time kept: a burst of another job's work stretches one run
            token_ids = ids(count)
            chosen = config if strategy is None else BlendConfig(strategy)
            job, segment_kv = self._synthetic_job(ids(total), chosen, generator)
            forward_s, blend_s, rows = float("inf"), float("inf"), 0
            for _ in range(CALIBRATION_RUNS):
                began = time.perf_counter()
                vllm_forward(token_ids)
                forward_s = min(forward_s, time.perf_counter() - began)
                outcome = BlendOutcome(job.request_id, total=total)
                if threads is not None:
                    threads(True)
                try:
                    began = time.perf_counter()
                    self._blend(job, chosen, outcome, segment_kv=segment_kv)
                    blend_s = min(blend_s, time.perf_counter() - began)
                finally:
                    if threads is not None:
                        threads(False)
                rows = outcome.rows
            vllm_points.append((vllm_features(count, 0).tolist(), forward_s))
            blend_points.append((blend_features(rows, total).tolist(), blend_s))
        return {"vllm": vllm_points, "blend": blend_points}

    def _synthetic_job(
        self, token_ids: list[int], config: BlendConfig, generator: torch.Generator
    ) -> tuple[BlendJob, SegmentKV]:
        """Return a job over ``token_ids`` and the in-memory store of its documents' random KV.

        The prompt head and question are computed, moved documents of 256 tokens lie between.
        """
        total = len(token_ids)
        kinds = np.full(total, int(TokenKind.COMPUTE), dtype=np.int8)
        shape, dtype = self.adapter.shape, self.adapter.dtype
        own = self.library.segment_kv
        segment_kv = SegmentKV(
            self.adapter, own.tokenizer, MemoryKVStore(), fingerprint=own.fingerprint,
            doc_prefix=None, kv_dtype=dtype, model_name=own.model_name,
            check_length=lambda tokens: None,
        )  # fmt: skip
        spans: list[PlannedSpan] = []
        for start in range(32, total - 32 - 255, 256):
            kinds[start : start + 256] = int(TokenKind.MOVED)
            cached = token_ids[start : start + 256]
            spans.append(PlannedSpan(start, start + 256, 0, TokenKind.MOVED, [], cached))
            kv = torch.randn(
                shape.num_layers, 2, shape.num_kv_heads, 256, shape.head_dim, generator=generator
            ).to(dtype)
            segment_kv.store.put(segment_key(own.fingerprint, [], cached), {KV_NAME: kv})
        plan = PrefillPlan(np.asarray(token_ids, dtype=np.int64), kinds, spans)
        blocks = list(range(1, 2 + total // self.block_size))  # free at start-up (the gate's)
        return BlendJob("kvblend-calibration", plan, config, 0, total - 1, blocks), segment_kv

    def run(self, job: BlendJob, checkpoint: Callable[[], None] = _no_pause) -> BlendOutcome:
        """Blend one job and write its rows; never raises, except when cancelled.

        ``checkpoint`` is called between the blend's steps (`pacing`): it may pause the blend
        until the next engine step, or raise `BlendCancelledError` (the job then ends there).

        A blend that fails runs again as ``full``; under tensor parallelism it does not (a
        rank running a pass the others do not would mismatch their collectives): its blocks
        are reported as failed loads at once, and vLLM computes them on every rank.
        """
        outcome = BlendOutcome(job.request_id, total=len(job.plan.token_ids))
        started = time.perf_counter()
        try:
            self._blend(job, job.config, outcome, checkpoint)
        except BlendCancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the exact computation takes over
            outcome.error = f"{type(error).__name__}: {error}"
            outcome.reused = outcome.recomputed = 0
            try:
                if self.adapter.tp_size > 1:
                    raise RuntimeError("not run again under tensor parallelism") from error
                self._blend(job, BlendConfig("full"), outcome, checkpoint)
            except BlendCancelledError:
                raise
            except Exception as again:  # noqa: BLE001 - vLLM recomputes the claimed blocks
                outcome.failed = True
                outcome.error += f"; computing in full failed too: {again}"
                self.failed_blocks.update(self._blocks(job))
        outcome.blend_s = time.perf_counter() - started
        return outcome

    def _blocks(self, job: BlendJob) -> list[int]:
        first, last = job.start // self.block_size, (job.stop - 1) // self.block_size
        return job.block_ids[first : last + 1]

    @torch.inference_mode()
    def _blend(
        self,
        job: BlendJob,
        config: BlendConfig,
        outcome: BlendOutcome,
        checkpoint: Callable[[], None] = _no_pause,
        segment_kv: SegmentKV | None = None,
    ) -> None:
        # entries read whole before the loop (a checkpoint between two), the ranks agreeing on
        # those they use; an unusable entry's rows are computed in full, as vLLM would compute
        # them. ``segment_kv``: another store's entries (the calibration's synthetic ones)
        blended = blend_plan(
            self.adapter, segment_kv or self.library.segment_kv, job.plan, config,
            read_whole=True, ranks=self.adapter, lost=outcome.lost, need_logits=False,
            cancel=Checkpoints(checkpoint),
        )  # fmt: skip
        out, kinds, looped = blended.out, blended.kinds, time.perf_counter()
        outcome.rows = round(out.stats.get("token_layers", 0) / self.adapter.shape.num_layers)
        outcome.timings = {
            "open_s": blended.open_s, "loop_s": blended.loop_s,
            "probe_s": float(out.stats.get("probe_s", 0.0)),
        }  # fmt: skip
        if config.reads_cache:
            cached = int((kinds != int(TokenKind.COMPUTE)).sum())
            outcome.recomputed = int(out.stats.get("recomputed_tokens", 0))
            outcome.reused = cached - outcome.recomputed
        device = self.adapter.device
        slots = slot_mapping(job.block_ids, self.block_size, job.start, job.stop, device)
        for layer, attention in enumerate(self.adapter.attention_layers):
            checkpoint()
            write_rows(attention, out.keys[layer], out.values[layer], job.start, job.stop, slots)
        outcome.timings["write_s"] = time.perf_counter() - looped

    def fill(
        self, documents: list[tuple[str, str]], checkpoint: Callable[[], None] = _no_pause
    ) -> int:
        """Compute and store the KV of documents found but not stored; return how many.

        Not under tensor parallelism: a rank computes its own KV heads only, and an entry holds
        every one (said once; such documents come from ``kvblend precompute``, or from a server
        without tensor parallelism, over the same store).
        """
        if self.adapter.tp_size > 1:
            if not self.fill_refused and self.adapter.tp_rank == 0:  # every rank would say it
                self.fill_refused = True
                logger.warning(
                    "kvblend: documents not stored yet are not stored by a tensor-parallel "
                    "server (tensor_parallel_size=%d: each rank computes only its own KV heads); "
                    "store them with `kvblend precompute`",
                    self.adapter.tp_size,
                )
            return 0
        segment_kv, done = self.library.segment_kv, 0
        for text, context in dict.fromkeys(documents):
            checkpoint()
            try:
                layout = segment_kv.layout(text, context)
                key = segment_key(segment_kv.fingerprint, layout.context_ids, layout.ids)
                if not self.library.store.contains(key):
                    segment_kv.compute(key, layout.context_ids, layout.ids)
                    done += 1
            except Exception as error:  # noqa: BLE001 - stored next time, or never: not an answer
                logger.warning("could not store a document's KV: %s", error)
        return done

    def take_failed_blocks(self) -> set[int]:
        """Blocks whose claimed rows could not be written since the last call."""
        failed, self.failed_blocks = self.failed_blocks, set()
        return failed
