"""TTFT with the documents' KV in a host memory tier and in a GPU memory tier, on a GPU.

Full prefill, `reuse` and the default with the documents' KV in a host memory tier and in a
GPU memory tier (`MemoryKVStore(device="cuda")`), at 4K and 16K tokens.

Usage: kvblend bench gpu-tier MODEL_FOLDER [--random-weights]

Speed only: ``--random-weights`` builds the model from the folder's ``config.json`` with random
weights (same shapes, same kernels, same time), so only the config and tokenizer files are
needed. Prints one line per prompt and strategy (median of 5 after 2 warm-ups, with the
engine's phase timings) and the ratios to full prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from kvblend import BlendConfig, BlendEngine
from kvblend.bench.speed.ttft import QUESTION, SYSTEM, build_documents
from kvblend.store import MemoryKVStore

STRATEGIES = (
    ("full", BlendConfig("full")),
    ("reuse", BlendConfig("reuse")),
    ("default", BlendConfig()),
)


def main(argv: list[str] | None = None) -> None:
    """Time every strategy at every length, documents in a host tier then in a GPU tier."""
    parser = argparse.ArgumentParser(
        prog="kvblend bench gpu-tier", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("model")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--lengths", default="4096,16384")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    torch.manual_seed(0)
    if args.random_weights:
        config = AutoConfig.from_pretrained(args.model)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    model = model.to("cuda").eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    for tier in ("cpu", "cuda"):
        engine = BlendEngine(model, tokenizer, store=MemoryKVStore(8 << 30, device=tier))
        for length in (int(n) for n in args.lengths.split(",")):
            documents = build_documents(engine, length, 512, length)
            engine.precompute(documents, progress=False)
            segments = engine.rag_segments(QUESTION, documents, system=SYSTEM)
            medians = {}
            for name, config in STRATEGIES:
                for _ in range(2):
                    engine.prefill(segments, config)
                runs = []
                for _ in range(5):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    out = engine.prefill(segments, config)
                    out.logits.float().sum().item()  # wait for the GPU
                    runs.append(time.perf_counter() - started)
                medians[name] = statistics.median(runs)
                phases = {k: round(v * 1000, 1) for k, v in out.stats.timings.items()}
                print(f"tier={tier} {length} {name}: {medians[name] * 1000:.1f} ms {phases}")
            print(
                f"tier={tier} {length}: reuse/full {medians['reuse'] / medians['full']:.2f}, "
                f"default/full {medians['default'] / medians['full']:.2f}"
            )


if __name__ == "__main__":
    main()
