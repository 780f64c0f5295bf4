"""Aten ops and host syncs of a blended prefill, counted on the CPU through ``engine.prefill``.

On a GPU every aten op the blend dispatches is a kernel launch (about 25 us of Python and
dispatch each), and every read of a device value on the host (``.item()``, ``int()``/``bool()``
of a tensor, ``nonzero``, ``bincount``, ``torch.equal``, boolean-mask indexing, ``.tolist()``)
waits for the device to finish. Both are properties of the code, not of the device, so they are
counted here on the CPU, where no GPU is needed: a `TorchDispatchMode` sees every op, and the
ops that would synchronise on CUDA are named in `SYNC_OPS`.

Counting covers the device work of a prefill, `kvblend.blend.prefill.run_blend` (every pass of
the strategy, stats included); the host-side planning before it builds its tensors from Python
lists. Syncs are counted before the logits (the host waiting for the prefill's own work) and
after them (the rows chosen on the device, read for the statistics once the work is queued).
Ops per layer per pass are the count divided by layers x passes: they do not depend on the
model's width or the prompt's length, so a test can assert them on a tiny model. They are the
eager loop's on the CPU: there sparse rows attend in query chunks (one SDPA call each), where
CUDA makes one FlexAttention call per layer.

``kvblend bench ops`` runs it on a 24-layer GQA model with random weights (16 documents x 512
tokens by default) and prints ops per layer per pass and syncs per prefill for each strategy.
"""

from __future__ import annotations

import argparse
import contextlib
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvblend.blend.config import BlendConfig, parse_setting
from kvblend.documents import blend_plan as blend_plan_module
from kvblend.engine.engine import BlendEngine
from kvblend.prompt.segments import Segment

#: Ops whose result (or output size) is read on the host: each one is a sync on CUDA.
SYNC_OPS = frozenset(
    {
        "aten._local_scalar_dense.default",  # .item(), int(), float(), bool() of a tensor
        "aten.nonzero.default",
        "aten.equal.default",
        "aten.bincount.default",
        "aten.masked_select.default",
        "aten.unique_consecutive.default",
        "aten._unique2.default",
        "aten.unique_dim.default",
        "aten.repeat_interleave.Tensor",
    }
)


@dataclass
class OpCount:
    """What one counted region dispatched."""

    ops: int = 0
    syncs: int = 0
    #: syncs before the logits were computed (the host waiting on the prefill's own work);
    #: those after them read what the prefill chose, for its statistics
    syncs_before_logits: int | None = None
    by_op: Counter[str] = field(default_factory=Counter)
    sync_ops: Counter[str] = field(default_factory=Counter)


def _is_sync(name: str, args: tuple[Any, ...]) -> bool:
    if name in SYNC_OPS:
        return True
    if name.startswith(("aten.index.Tensor", "aten.index_put")):  # boolean-mask indexing
        indices = args[1] if len(args) > 1 else ()
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
    return False


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, and those that sync with the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = OpCount()
        self.active = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.active:
            name = str(func)
            if _is_sync(name, args):
                self.count.syncs += 1
                self.count.sync_ops[name] += 1
            # Views and no-op conversions (``.to`` the same dtype) launch nothing.
            if not func.is_view and (func._schema.is_mutable or not (args and out is args[0])):
                self.count.ops += 1
                self.count.by_op[name] += 1
        return out


@contextlib.contextmanager
def _tolist_counted(counter: OpCounter) -> Iterator[None]:
    """Count ``Tensor.tolist`` (a device-to-host copy on CUDA, invisible to dispatch on the CPU)."""
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor) -> Any:
        if counter.active:
            counter.count.syncs += 1
            counter.count.sync_ops["Tensor.tolist"] += 1
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]


def count_prefill(
    engine: BlendEngine, prompt: Any, config: BlendConfig, whole: bool = False
) -> tuple[OpCount, Any]:
    """Run ``engine.prefill(prompt, config)`` and count the ops and syncs of its blend.

    ``syncs_before_logits``: the syncs counted when the model adapter's ``logits`` was called.
    ``whole``: count the whole prefill, from the prompt's planning and the store's reads of
    its entries on (the blend alone otherwise).
    """
    counter = OpCounter()
    real = blend_plan_module.run_blend
    decoder = engine.decoder
    real_logits = decoder.logits

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.active = True
        try:
            return real(*args, **kwargs)
        finally:
            counter.active = whole

    def logits(hidden: Any) -> Any:
        if counter.active and counter.count.syncs_before_logits is None:
            counter.count.syncs_before_logits = counter.count.syncs
        return real_logits(hidden)

    counter.active = whole
    blend_plan_module.run_blend = counted
    decoder.logits = logits  # type: ignore[method-assign]
    try:
        with counter, _tolist_counted(counter):
            result = engine.prefill(prompt, config)
    finally:
        blend_plan_module.run_blend = real
        del decoder.logits
    return counter.count, result


def passes(config: BlendConfig) -> int:
    """Return the passes over the layers a strategy runs (the attention probe is one more)."""
    return 2 if config.strategy == "attention" and config.recompute_ratio > 0 else 1


def random_documents(count: int, tokens: int, seed: int = 0) -> list[str]:
    """``count`` documents of ``tokens`` ASCII letters and spaces (one token a byte)."""
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz     "
    return ["".join(rng.choice(alphabet) for _ in range(tokens)) for _ in range(count)]


def byte_engine(
    layers: int,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    device: str = "cpu",
    kv_codec: str = "none",
) -> BlendEngine:
    """Build an engine over a random-weight Qwen2-shaped GQA model and a byte-level tokenizer.

    ``device``: where the model runs (its documents' KV is kept there too); ``kv_codec``: how
    the documents' KV is stored (`kvblend.blend.kv_codec`).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from kvblend.store import MemoryKVStore

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2} | {c: i + 3 for i, c in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 2)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=65536,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval().to(device)
    return BlendEngine(
        model, fast, store=MemoryKVStore(8 << 30), name=f"qwen2-{layers}-layers", kv_codec=kv_codec
    )


def rag_prompt(documents: list[str]) -> list[Segment]:
    """Return segments: a prefix, the documents (moved: precomputed alone), a question."""
    return [
        Segment("Answer from the documents.\n", role="prefix"),
        *(Segment(text + "\n") for text in documents),
        Segment("Question: which document says the most?", cache=False),
    ]


def ops_config(name: str) -> BlendConfig:
    """Return the config a strategy name stands for.

    ``default`` or a strategy, then ``+NAME=VALUE`` settings (``default+early_layers=0.25``).
    """
    base, *overrides = name.split("+")
    config = BlendConfig() if base == "default" else BlendConfig(base)
    return config.replace(**dict(parse_setting(text) for text in overrides))


def run_ops(
    engine: BlendEngine, documents: int, doc_tokens: int, strategies: list[str]
) -> list[dict[str, Any]]:
    """Count every strategy's ops and syncs on one prompt; one row per strategy."""
    texts = random_documents(documents, doc_tokens)
    engine.precompute([text + "\n" for text in texts], progress=False)
    prompt = rag_prompt(texts)
    layers = engine.decoder.shape.num_layers
    rows = []
    for strategy in strategies:
        config = ops_config(strategy)
        engine.prefill(prompt, config)  # warm: lazy imports, first-call caches
        count, result = count_prefill(engine, prompt, config)
        rows.append(
            {
                "strategy": strategy,
                "prompt_tokens": result.stats.prompt_tokens,
                "passes": passes(config),
                "ops": count.ops,
                "ops_per_layer_pass": count.ops / (layers * passes(config)),
                "syncs": count.syncs,
                "syncs_before_logits": count.syncs_before_logits,
                "sync_ops": dict(count.sync_ops),
                "top_ops": dict(count.by_op.most_common(12)),
            }
        )
    return rows


def ops_table(rows: list[dict[str, Any]]) -> str:
    """Markdown of `run_ops`."""
    lines = [
        "| strategy | prompt | passes | aten ops / layer / pass | host syncs before the logits "
        "| after |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        before = row["syncs_before_logits"]
        before = row["syncs"] if before is None else before
        lines.append(
            f"| {row['strategy']} | {row['prompt_tokens']} | {row['passes']} | "
            f"{row['ops_per_layer_pass']:.1f} | {before} | {row['syncs'] - before} |"
        )
    return "\n".join(lines)


def add_ops_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvblend bench ops``."""
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=64, help="width (counts do not depend on it)")
    parser.add_argument("--documents", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--strategies", default="reuse,default,cacheblend,epic,full")
    parser.add_argument("--verbose", action="store_true", help="print the most frequent ops")
    parser.add_argument(
        "--kv-codec", default="none", help="how the documents' KV is stored: none, int8, k8v4, int4"
    )


def cmd_ops(args: argparse.Namespace) -> None:
    """Print ops per layer per pass and syncs per prefill of every strategy."""
    torch.set_num_threads(1)
    engine = byte_engine(args.layers, hidden=args.hidden, kv_codec=args.kv_codec)
    rows = run_ops(engine, args.documents, args.doc_tokens, args.strategies.split(","))
    print(
        f"{args.layers}-layer GQA model (random weights), {args.documents} documents x "
        f"{args.doc_tokens} tokens, KV codec {engine.kv_codec.name}, counted through "
        "engine.prefill:\n"
    )
    print(ops_table(rows))
    for row in rows:
        if args.verbose or row["syncs"]:
            print(f"\n{row['strategy']}: syncs {row['sync_ops']}")
        if args.verbose:
            print(f"  top ops {row['top_ops']}")
