"""A claimed request's blend, the parity gate and documents stored: the worker side's work.

For every request the scheduler side claimed (a `BlendJob`), `run_job` runs the engine's own
blend (`kvblend.documents.blend_plan.blend_plan`: the plan's entries read whole, the blend loop)
over the whole prompt through `VLLMAdapter` (vLLM's loaded modules), with the request's
`BlendConfig`, and writes the rows vLLM did not compute itself (``[start, stop)``) into its paged
cache, layer by layer (`paged.write_rows`). vLLM's forward then computes the last prompt token
over that cache. Between its steps (two layers of the loop, two entries read, two layers
written) a job may ``pause`` until the engine's next step (`pacing`) and stops once cancelled.

Faults never reach an answer: an entry that is missing or cannot be used (damaged, of another
shape, a store outage) has its rows computed by the blend in full, which is what vLLM would
compute; a blend that fails for any other reason runs again as ``full`` (exact), and if even
that fails nothing is written and the request is reported as a failed load (vLLM computes the
claimed tokens).

`gate` runs the parity gate: the blend loop with strategy ``full`` against vLLM's own forward
(`compat.reference_logits`) on the engine's parity text (`kvblend.models.parity`). `store`
computes and stores documents found but not stored yet, so the next prompt reuses them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from kvblend.blend.config import BlendConfig
from kvblend.blend.forecast import Lost
from kvblend.blend.loop import CancelFlag, Pause, stop_if_cancelled
from kvblend.documents.blend_plan import blend_plan
from kvblend.documents.library import DocumentLibrary
from kvblend.documents.segment_kv import SegmentKV
from kvblend.errors import BlendCancelledError
from kvblend.models.parity import PARITY_TEXT, parity_error, parity_tolerance
from kvblend.prompt.plan import TokenKind
from kvblend.prompt.tokens import encode_prompt
from kvblend.vllm.execution.adapter import VLLMAdapter
from kvblend.vllm.execution.paged import slot_mapping, write_rows
from kvblend.vllm.requests import BlendJob, BlendOutcome

logger = logging.getLogger("kvblend.vllm")

__all__ = ["WorkerModel", "blend_into_cache", "gate", "run_job", "store"]


class WorkerModel(NamedTuple):
    """What a worker blends with: vLLM's model, the documents over the store, the block size."""

    adapter: VLLMAdapter
    library: DocumentLibrary
    block_size: int


def _no_pause() -> None:
    """Never pause (a job run in one go)."""


def gate(model: WorkerModel, reference_logits: Callable[[list[int]], Any]) -> tuple[bool, str]:
    """Run the parity gate; ``reference_logits(ids)`` is vLLM's own forward.

    Under tensor parallelism every rank computes the logits (vLLM gathers them to every rank on
    this platform) and the verdict is taken on the worst rank's error, so every rank reaches the
    same one.
    """
    adapter = model.adapter
    ids = encode_prompt(model.library.segment_kv.tokenizer, PARITY_TEXT).ids.tolist()
    failed = None
    try:
        error = parity_error(adapter, reference_logits(ids), ids)
    except Exception as failure:  # noqa: BLE001 - any failure closes the gate
        error, failed = float("inf"), failure
    try:
        worst = float(adapter.gather_ranks(torch.tensor([error])).max())
    except Exception as failure:  # noqa: BLE001 - the ranks could not agree: closed
        return False, f"the parity gate could not compare the ranks' verdicts: {failure}"
    if failed is not None or worst == float("inf"):
        why = failed if failed is not None else "it failed on another tensor-parallel rank"
        return False, f"the parity gate could not run vLLM's forward: {why}"
    tolerance = parity_tolerance(adapter.dtype)
    if not worst <= tolerance:
        return False, (
            f"kvblend's layer loop does not reproduce vLLM's forward pass (relative logit "
            f"error {worst:.3g} > {tolerance:g}): refusing to blend"
        )
    return True, f"parity gate passed (relative logit error {worst:.3g})"


def run_job(
    model: WorkerModel,
    job: BlendJob,
    pause: Pause = _no_pause,
    cancel: CancelFlag | None = None,
) -> BlendOutcome:
    """Blend one job and write its rows; never raises, except when cancelled.

    A blend that fails runs again as ``full``; under tensor parallelism it does not (a rank
    running a pass the others do not would mismatch their collectives): it is reported failed
    at once (nothing written), and vLLM computes its tokens on every rank.
    """
    outcome = BlendOutcome(job.request_id, total=len(job.plan.token_ids))
    started = time.perf_counter()
    try:
        blend_into_cache(model, job, job.config, outcome, pause, cancel)
    except BlendCancelledError:
        raise
    except Exception as error:  # noqa: BLE001 - the exact computation takes over
        outcome.error = f"{type(error).__name__}: {error}"
        outcome.reused = outcome.recomputed = 0
        try:
            if model.adapter.tp_size > 1:
                raise RuntimeError("not run again under tensor parallelism") from error
            blend_into_cache(model, job, BlendConfig("full"), outcome, pause, cancel)
        except BlendCancelledError:
            raise
        except Exception as again:  # noqa: BLE001 - vLLM computes the claimed tokens
            outcome.failed = True
            outcome.error += f"; computing in full failed too: {again}"
    outcome.blend_s = time.perf_counter() - started
    return outcome


@torch.inference_mode()
def blend_into_cache(
    model: WorkerModel,
    job: BlendJob,
    config: BlendConfig,
    outcome: BlendOutcome,
    pause: Pause = _no_pause,
    cancel: CancelFlag | None = None,
    segment_kv: SegmentKV | None = None,
) -> None:
    """Blend ``job`` with ``config`` and write its rows; count what it did into ``outcome``.

    Entries are read whole before the loop, the ranks agreeing on those they use; an unusable
    entry's rows are computed in full, as vLLM would compute them. ``segment_kv``: the entries
    of another store (the calibration's synthetic ones).
    """
    adapter = model.adapter
    selector = config.selector()  # the blend's own
    lost: list[Lost] = []  # the entries not used, as they are found
    try:
        blended = blend_plan(
            adapter,
            segment_kv or model.library.segment_kv,
            job.plan,
            selector,
            read_whole=True,
            ranks=adapter,
            lost=lost,
            need_logits=False,
            cancel=cancel,
            pause=pause,
        )
    finally:
        outcome.lost += [str(entry) for entry in lost]  # the outcome's words (a message)
    out, kinds, looped = blended.out, blended.kinds, time.perf_counter()
    outcome.rows = round(out.counts.token_layers / adapter.shape.num_layers)
    outcome.timings = {
        "open_s": blended.open_s,
        "loop_s": blended.loop_s,
        "probe_s": out.counts.probe_s,
    }
    if selector.reads_cache:
        cached = int((kinds != int(TokenKind.COMPUTE)).sum())
        outcome.recomputed = out.read.recomputed_tokens
        outcome.reused = cached - outcome.recomputed
    slots = slot_mapping(job.block_ids, model.block_size, job.start, job.stop, adapter.device)
    for layer, attention in enumerate(adapter.attention_layers):
        stop_if_cancelled(cancel, pause)
        write_rows(attention, out.keys[layer], out.values[layer], job.start, job.stop, slots)
    outcome.timings["write_s"] = time.perf_counter() - looped


def store(
    model: WorkerModel,
    documents: list[tuple[str, str]],
    pause: Pause = _no_pause,
    cancel: CancelFlag | None = None,
) -> int:
    """Compute and store the KV of documents found but not stored (text, context); how many.

    Not under tensor parallelism (the caller says why, once): a rank computes its own KV heads
    only, and an entry holds every one.
    """
    segment_kv, done = model.library.segment_kv, 0
    for text, context in dict.fromkeys(documents):
        stop_if_cancelled(cancel, pause)
        try:
            layout = segment_kv.layout(text, context)
            key = segment_kv.entry_key(layout.context_ids, layout.ids)
            if not model.library.store.contains(key):
                segment_kv.compute(key, layout.context_ids, layout.ids)
                done += 1
        except Exception as error:  # noqa: BLE001 - stored next time, or never: not an answer
            logger.warning("could not store a document's KV: %s", error)
    return done
