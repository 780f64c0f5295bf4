"""The connector's worker side: blend each claimed request before vLLM's forward, write its KV.

For every request the scheduler side claimed (`BlendJob`), ``start_load_kv`` runs the engine's
own blend loop (`kvblend.engine.blend.run_blend`) over the whole prompt, with the request's
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

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvblend.engine.blend import COMPUTE, BlendInput, CachedSpan, run_blend
from kvblend.engine.config import BlendConfig
from kvblend.engine.library import DocumentLibrary
from kvblend.engine.parity import PARITY_TEXT, parity_tolerance
from kvblend.engine.prompt import PrefillPlan, TokenKind, encode_prompt
from kvblend.engine.segments import KV_NAME, segment_key
from kvblend.engine.stored_rows import StoredRows

from .adapter import VLLMAdapter
from .paged import slot_mapping, write_rows

logger = logging.getLogger(__name__)

__all__ = ["BlendJob", "BlendOutcome", "WorkerSide", "parity_verdict"]


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
    blend_s: float = 0.0
    #: where the time went: reading entries, the blend loop (its probe pass apart), writing KV
    timings: dict[str, float] = field(default_factory=dict)


def parity_verdict(adapter: VLLMAdapter, reference: torch.Tensor, ids: list[int]) -> float:
    """Relative error of the blend loop's (``full``) last logits against vLLM's ``reference``."""
    token_ids = torch.tensor(ids, dtype=torch.long)
    kinds = torch.full((len(ids),), COMPUTE, dtype=torch.int8)
    got = run_blend(adapter, BlendInput(token_ids, kinds, []), BlendConfig("full")).logits
    assert got is not None
    return float((got - reference).abs().max() / reference.abs().max().clamp_min(1e-6))


class WorkerSide:
    """Blends claimed requests into vLLM's paged cache in one worker process."""

    def __init__(self, adapter: VLLMAdapter, library: DocumentLibrary, block_size: int) -> None:
        self.adapter = adapter
        self.library = library
        self.block_size = block_size
        self.failed_blocks: set[int] = set()

    def gate(self, reference_logits: Any) -> tuple[bool, str]:
        """Run the parity gate; ``reference_logits(ids)`` is vLLM's own forward."""
        ids = encode_prompt(self.library.segment_kv.tokenizer, PARITY_TEXT).ids.tolist()
        try:
            error = parity_verdict(self.adapter, reference_logits(ids), ids)
        except Exception as failure:  # noqa: BLE001 - any failure closes the gate
            return False, f"the parity gate could not run vLLM's forward: {failure}"
        tolerance = parity_tolerance(self.adapter.dtype)
        if not error <= tolerance:
            return False, (
                f"kvblend's layer loop does not reproduce vLLM's forward pass (relative logit "
                f"error {error:.3g} > {tolerance:g}): refusing to blend"
            )
        return True, f"parity gate passed (relative logit error {error:.3g})"

    def run(self, job: BlendJob) -> BlendOutcome:
        """Blend one job and write its rows; never raises."""
        outcome = BlendOutcome(job.request_id)
        started = time.perf_counter()
        try:
            self._blend(job, job.config, outcome)
        except Exception as error:  # noqa: BLE001 - the exact computation takes over
            outcome.error = f"{type(error).__name__}: {error}"
            outcome.reused = outcome.recomputed = 0
            try:
                self._blend(job, BlendConfig("full"), outcome)
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
    def _blend(self, job: BlendJob, config: BlendConfig, outcome: BlendOutcome) -> None:
        plan, began = job.plan, time.perf_counter()
        kinds = np.array(plan.kinds, dtype=np.int8)  # a copy: lost entries change it
        spans = self._open(plan, kinds, outcome) if config.reads_cache else []
        token_ids = torch.as_tensor(np.asarray(plan.token_ids, dtype=np.int64))
        blend_input = BlendInput(token_ids, torch.from_numpy(kinds), spans, kinds)
        opened = time.perf_counter()
        out = run_blend(self.adapter, blend_input, config, need_logits=False)
        blended = time.perf_counter()
        outcome.timings = {
            "open_s": opened - began, "loop_s": blended - opened,
            "probe_s": float(out.stats.get("probe_s", 0.0)),
        }  # fmt: skip
        if config.reads_cache:
            cached = int((kinds != int(TokenKind.COMPUTE)).sum())
            outcome.recomputed = int(out.stats.get("recomputed_tokens", 0))
            outcome.reused = cached - outcome.recomputed
        device = self.adapter.device
        slots = slot_mapping(job.block_ids, self.block_size, job.start, job.stop, device)
        for layer, attention in enumerate(self.adapter.attention_layers):
            write_rows(attention, out.keys[layer], out.values[layer], job.start, job.stop, slots)
        outcome.timings["write_s"] = time.perf_counter() - blended

    def _open(
        self, plan: PrefillPlan, kinds: np.ndarray, outcome: BlendOutcome
    ) -> list[CachedSpan]:
        """Open and read the plan's entries; rows of one that cannot be used are computed.

        Each entry is read whole here, before the loop (the store checks its checksum, shape,
        dtype and finite values as it reads), so a damaged or foreign entry makes its rows
        computed in full, as vLLM would compute them, rather than recomputed mid-prompt.
        """
        segment_kv, spans = self.library.segment_kv, []
        for span in plan.spans:
            key = segment_key(segment_kv.fingerprint, span.context_ids, span.cached_ids)
            tokens = len(span.cached_ids)
            try:
                entry = segment_kv.open_entry(key, tokens, self.adapter.device)
                if entry is None:
                    outcome.lost.append(f"entry {key[:12]} not in the store")
                else:
                    entry = {KV_NAME: entry[KV_NAME]}  # read (and checked) now
            except Exception as error:  # noqa: BLE001 - damaged or foreign: computed instead
                segment_kv.drop(key)
                outcome.lost.append(f"entry {key[:12]} unusable ({error})")
                entry = None
            if entry is None:
                kinds[span.start : span.end] = int(TokenKind.COMPUTE)
                continue
            rows = slice(span.cached_start, span.cached_start + span.end - span.start)
            recompute = functools.partial(
                segment_kv.compute, key, span.context_ids, span.cached_ids
            )
            stored = StoredRows(entry, rows, recompute, segment_kv.entry_shape(tokens))
            spans.append(CachedSpan(span.start, span.end, stored, span.kind))
        return spans

    def fill(self, documents: list[tuple[str, str]]) -> int:
        """Compute and store the KV of documents found but not stored; return how many."""
        segment_kv, done = self.library.segment_kv, 0
        for text, context in dict.fromkeys(documents):
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
