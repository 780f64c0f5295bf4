"""Prefills in bfloat16: the floor a blend's closeness is read against, and blends in bfloat16.

A blend changes only the prefill. How far its first-token distribution and its answers may be
asked to follow float32 full prefill's is bounded below by what rounding alone does to full
prefill: the same model, the same prompt, every tensor kept in bfloat16 (the dtype most models
are served in). `RoundedPrefill` runs that prefill on a bfloat16 copy of an engine's model and
hands back its KV and logits in the engine's own dtype, so the engine decodes from them in
float32: prefill-only rounding (``full@bf16-prefill``), or decodes on the bfloat16 copy too,
rounding the whole answer (``full@bf16``). Any strategy runs the same way on the copy
(``default@bf16``: the default blend as a bfloat16 engine runs it, decoded there).

`Bfloat16Products` makes that affordable on CPUs without bfloat16 matrix units (AVX2 machines,
where a bfloat16 product runs several times slower than a float32 one): every tensor stays
bfloat16, only the matrix products and attention (``linear``, ``matmul``, ``mm``, ``bmm``,
``scaled_dot_product_attention``) take their bfloat16 inputs up to float32, compute there and
round the result to bfloat16: what bfloat16 matrix units do (bfloat16 products are exact in
float32, sums are accumulated in float32, the output is rounded), up to the order of the sums.
Attention's own internals stay float32 (some kernels round its weights to bfloat16 before the
second product).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvblend.blend.config import BlendConfig
from kvblend.engine.engine import BlendEngine
from kvblend.engine.results import PrefillResult

__all__ = ["ROUNDINGS", "Bfloat16Products", "RoundedPrefill", "rounded_products"]

#: How the rounded engine computes its products: ``emulated`` (`Bfloat16Products`: float32
#: products of bfloat16 values, rounded), ``native`` (torch's own bfloat16 kernels).
ROUNDINGS = ("emulated", "native")

_aten = torch.ops.aten
#: The ops whose bfloat16 inputs are computed in float32 and whose output is rounded back.
PRODUCTS = frozenset(
    {
        _aten.linear.default,
        _aten.matmul.default,
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        _aten.baddbmm.default,
        _aten.scaled_dot_product_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
    }
)


def _up(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
        return value.float()
    return value


class Bfloat16Products(TorchDispatchMode):
    """Matrix products and attention of bfloat16 tensors computed in float32, rounded to bfloat16.

    Every other op runs as it is called (in bfloat16 on bfloat16 tensors). ``products`` counts
    the ops taken up to float32, so a caller can check the mode saw the model's products.
    """

    def __init__(self) -> None:
        super().__init__()
        self.products = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func not in PRODUCTS or not any(
            isinstance(arg, torch.Tensor) and arg.dtype == torch.bfloat16 for arg in args
        ):
            return func(*args, **kwargs)
        self.products += 1
        out = func(*[_up(arg) for arg in args], **{key: _up(v) for key, v in kwargs.items()})
        if isinstance(out, tuple):  # a fused attention kernel: (output, logsumexp)
            return (out[0].to(torch.bfloat16), *out[1:])
        return out.to(torch.bfloat16)


@contextlib.contextmanager
def rounded_products(rounding: str) -> Iterator[None]:
    """Run the block under `Bfloat16Products` (``emulated``) or as it is (``native``)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; use {', '.join(ROUNDINGS)}")
    if rounding == "native":
        yield
        return
    with Bfloat16Products():
        yield


class RoundedPrefill:
    """Prefills of ``engine``'s prompts on a bfloat16 copy of its model.

    The copy (the engine's model deep-copied and cast, with its tokenizer, system prompt,
    document context and KV codec, and an in-memory store of its own) is built on first use;
    its documents are precomputed there, in bfloat16, when a blend needs them.
    """

    def __init__(self, engine: BlendEngine, rounding: str = "emulated") -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"unknown rounding {rounding!r}; use {', '.join(ROUNDINGS)}")
        self.engine = engine
        self.rounding = rounding
        self._rounded: BlendEngine | None = None

    @property
    def rounded(self) -> BlendEngine:
        """The bfloat16 engine (built on first use)."""
        if self._rounded is None:
            from kvblend.store import MemoryKVStore

            model = copy.deepcopy(self.engine.model).to(torch.bfloat16)
            self._rounded = BlendEngine(
                model,
                self.engine.tokenizer,
                store=MemoryKVStore(1 << 30),
                system_prompt=self.engine.system_prompt,
                doc_prefix=self.engine.doc_prefix,
                name=str(self.engine.name),
                check_parity=False,
                threads=torch.get_num_threads(),
                kv_codec=self.engine.kv_codec,
            )
        return self._rounded

    def rounded_prefill(
        self, segments: Any, config: BlendConfig | None = None, documents: Sequence[str] = ()
    ) -> PrefillResult:
        """Prefill on the bfloat16 copy (full prefill unless ``config`` says otherwise).

        ``documents`` are precomputed on the copy first. Returned as the copy returns it.
        """
        with rounded_products(self.rounding), torch.inference_mode():
            if documents:
                self.rounded.precompute(list(documents), progress=False)
            return self.rounded.prefill(segments, config or BlendConfig("full"))

    def in_engine_dtype(self, pre: PrefillResult) -> PrefillResult:
        """``pre`` with its logits in float32 and its keys and values in the engine's dtype."""
        dtype = self.engine.decoder.dtype
        return PrefillResult(
            pre.logits.float(),
            pre.token_ids,
            pre.stats,
            [k.to(dtype) for k in pre.keys],
            [v.to(dtype) for v in pre.values],
        )

    def prefill(self, segments: Any) -> PrefillResult:
        """Full prefill in bfloat16, returned in the engine's dtype (the engine decodes it)."""
        return self.in_engine_dtype(self.rounded_prefill(segments))

    def decode(self, pre: PrefillResult, **decoding: Any) -> Any:
        """Decode a `rounded_prefill` on the bfloat16 copy (the whole answer rounded)."""
        with rounded_products(self.rounding), torch.inference_mode():
            return self.rounded.generate(pre, **decoding)
