"""`GenerationMixin`: `BlendEngine`'s ``generate``, ``generate_batch`` and ``stream``.

Each prefills its prompt with the engine's blended ``prefill`` (or takes a `PrefillResult`
already made), then decodes from the fused cache with transformers' ``generate``
(`kvblend.decoding.generation`, `kvblend.decoding.batch`). The decoding options are checked
before any model work. A mixin, as transformers' own ``GenerationMixin`` puts ``generate`` on
its models: these methods are part of `BlendEngine`'s API and use only its ``model``,
``tokenizer``, ``context_window`` and ``prefill``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvblend.blend.config import BlendConfig, check_config
from kvblend.decoding.batch import decode_batch
from kvblend.decoding.generation import GenerationResult, decode, decode_stream
from kvblend.decoding.options import DecodeOptions
from kvblend.engine.results import PrefillResult
from kvblend.errors import BlendCancelledError
from kvblend.prompt.segments import PromptLike, Segment
from kvblend.validation import check_cancel, check_prompt


class GenerationMixin:
    """Generation from a blended prefill, for `BlendEngine`."""

    model: torch.nn.Module
    tokenizer: Any

    if TYPE_CHECKING:  # provided by BlendEngine

        @property
        def context_window(self) -> int:
            """Longest prompt plus generation the model accepts, in tokens."""

        def prefill(
            self,
            prompt: PromptLike,
            config: BlendConfig | None = None,
            *,
            cancel: threading.Event | None = None,
        ) -> PrefillResult:
            """Blended prefill of a prompt (`BlendEngine.prefill`)."""

    def _prefilled(
        self,
        prompt: PromptLike | PrefillResult,
        config: BlendConfig | None,
        cancel: threading.Event | None = None,
    ) -> PrefillResult:
        """``prompt`` itself when it is a prefill result already, else its prefill."""
        if isinstance(prompt, PrefillResult):
            return prompt
        return self.prefill(prompt, config, cancel=cancel)

    def generate(
        self,
        segments: Sequence[Segment | str] | PrefillResult,
        config: BlendConfig | None = None,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        cancel: threading.Event | None = None,
        top_k: int = 0,
        repetition_penalty: float = 1.0,
        do_sample: bool | None = None,
    ) -> GenerationResult:
        """Blended prefill, then decoding from the fused cache; returns text, TTFT and stats.

        The decoding options are transformers' (see `kvblend.decoding.options.DecodeOptions`):
        ``temperature=0`` decodes greedily unless ``do_sample=True``; ``top_k``, ``top_p`` and
        ``repetition_penalty`` go through transformers' own logits processors, for the first
        token (drawn from the blended logits) as for every later one. ``cancel``: once set,
        prefill stops before its next layer and decoding after its next token; either raises
        `BlendCancelledError`.
        """
        started = time.perf_counter()
        options: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            repetition_penalty=repetition_penalty, do_sample=do_sample, stop=stop, seed=seed,
        )  # fmt: skip
        DecodeOptions(**options).check()  # before any model work
        _check_call(segments, config, cancel)
        pre = self._prefilled(segments, config, cancel)
        return decode(
            self.model, self.tokenizer, pre.token_ids, pre.logits, pre.keys, pre.values, pre.stats,
            started=started, cancel=cancel, **options,
        )  # fmt: skip

    def generate_batch(
        self,
        prompts: Sequence[PromptLike | PrefillResult],
        config: BlendConfig | None = None,
        **options: Any,
    ) -> list[GenerationResult]:
        """`generate` for several prompts: each prefilled on its own, then decoded together.

        ``options`` are `generate`'s decoding keywords, common to every prompt. One batched
        decode reads the weights once per step for every prompt; each result equals that
        prompt's own `generate` (positions stay exact under the padding), up to floating-point
        rounding of the batched kernels. A prompt whose output budget the context window clips
        is decoded alone. Each result's ``ttft_s`` is the time from the call to the first tokens
        of the whole batch (every prompt prefilled), and its ``stats.timings["prefill_s"]`` that
        prompt's own prefill.
        """
        started = time.perf_counter()
        DecodeOptions(**options).check()  # an unknown keyword is a TypeError here
        if isinstance(prompts, (str, PrefillResult)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        for prompt in prompts:  # every one, before the first prefill
            _check_call(prompt, config, None)
        pres = [self._prefilled(prompt, config) for prompt in prompts]
        budget = int(options.get("max_new_tokens", 64))
        limit = self.context_window
        fits = [i for i, p in enumerate(pres) if not limit or len(p.token_ids) + budget <= limit]
        results: dict[int, GenerationResult] = {}
        if len(fits) > 1:
            batch = [pres[i] for i in fits]
            decoded = decode_batch(self.model, self.tokenizer, batch, started=started, **options)
            results.update(zip(fits, decoded, strict=True))
        for index, pre in enumerate(pres):
            if index not in results:
                results[index] = self.generate(pre, **options)
        return [results[index] for index in range(len(pres))]

    def stream(
        self,
        segments: Sequence[Segment | str] | PrefillResult,
        config: BlendConfig | None = None,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        cancel: threading.Event | None = None,
        top_k: int = 0,
        repetition_penalty: float = 1.0,
        do_sample: bool | None = None,
    ) -> Iterator[str]:
        """Like `generate`, yielding text pieces as they are decoded."""
        options: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            repetition_penalty=repetition_penalty, do_sample=do_sample, stop=stop, seed=seed,
        )  # fmt: skip
        DecodeOptions(**options).check()  # before any model work
        _check_call(segments, config, cancel)
        pre = self._prefilled(segments, config, cancel)
        for piece in decode_stream(
            self.model, self.tokenizer, pre.token_ids, pre.logits, pre.keys, pre.values, **options
        ):
            if cancel is not None and cancel.is_set():  # closing decode_stream stops decoding
                raise BlendCancelledError("the generation was cancelled")
            yield piece


def _check_call(prompt: object, config: object, cancel: object) -> None:
    """Refuse a prompt, config or cancel event of the wrong type, before any model work."""
    if not isinstance(prompt, PrefillResult):
        check_prompt(prompt)
    check_config(config)
    check_cancel(cancel)
