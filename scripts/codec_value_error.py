"""How closely each KV codec decodes real stored K/V: relative squared error of keys and values.

The documents are the first ``--passages`` passages of the NQ corpus, precomputed by the engine
as it stores them (keys before RoPE, the model's KV dtype); every codec encodes and decodes
those very tensors. The error of a part (keys or values) is ``sum((decoded - kv)^2) /
sum(kv^2)`` over every layer, head, token and channel of every passage. ``k8v4 v1`` is the
codec's first version (values per token on an even grid), kept here for comparison with the
current ``k8v4`` (values turned by a Hadamard matrix, coded on a Gaussian's Lloyd-Max levels).

    python scripts/codec_value_error.py --data ../shared/data/nq_open_gold_2000.jsonl.gz \
        [--passages 12] [--model PATH] [--dtype bf16] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvblend import BlendEngine
from kvblend.bench.quality.nq import load_nq
from kvblend.blend.kv_codec import CODECS, KVCodec

#: The codecs compared: every quantized one, and ``k8v4`` as its version 1 stored it.
COMPARED: dict[str, KVCodec] = {
    "int8": CODECS["int8"],
    "k8v4 v1": KVCodec("k8v4", 8, 4),
    "k8v4": CODECS["k8v4"],
    "int4": CODECS["int4"],
}


def relative_errors(engine: BlendEngine, texts: Sequence[str]) -> dict[str, dict[str, float]]:
    """Return, per codec, the relative squared error of keys and of values over ``texts``."""
    engine.precompute(list(texts), progress=False)
    sums: dict[str, list[float]] = {name: [0.0, 0.0] for name in COMPARED}
    reference = [0.0, 0.0]
    for text in texts:
        entry = engine.store.get(engine.segment_id(text))
        if entry is None:
            raise RuntimeError(f"no stored entry for {text[:40]!r}")
        kv = entry["kv"].float()
        for part in (0, 1):
            reference[part] += float(kv[:, part].square().sum())
        for name, codec in COMPARED.items():
            decoded = codec.open(codec.encode(kv), tuple(kv.shape)).decode()
            for part in (0, 1):
                sums[name][part] += float((decoded[:, part] - kv[:, part]).square().sum())
    return {name: {"keys": keys / reference[0], "values": values / reference[1]}
            for name, (keys, values) in sums.items()}  # fmt: skip


def main() -> None:
    """Precompute the passages, encode and decode them by every codec, print the errors."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--data", required=True, help="the NQ-open jsonl(.gz) file")
    parser.add_argument("--model", default=None, help="model folder, GGUF file or hub id")
    parser.add_argument("--dtype", default="bf16", help="the engine's dtype (default: bf16)")
    parser.add_argument("--passages", type=int, default=12)
    parser.add_argument("--output", help="write the result (json)")
    args = parser.parse_args()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    engine = BlendEngine.from_pretrained(args.model, dtype=dtype, threads=1)
    corpus, _ = load_nq(args.data)
    texts = [f"{passage.title}\n{passage.text}" for passage in corpus[: args.passages]]
    errors = relative_errors(engine, texts)
    result: dict[str, Any] = {
        "benchmark": "codec-value-error", "model": str(engine.name), "dtype": args.dtype,
        "passages": len(texts), "data": args.data,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "errors": errors,
        "values_v2_vs_v1": errors["k8v4"]["values"] / errors["k8v4 v1"]["values"],
    }  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(text + "\n")


if __name__ == "__main__":
    main()
