"""What checking an entry against the model costs: reading a disk entry with and without it.

Writes one realistic entry (30 layers x 3 KV heads x 512 tokens x 64, fp32 by default: 23.6 MB)
into a disk store, then reads every tensor of it many times through ``get()`` alone (checksums
only) and through ``get(expect=...)`` (shape, dtype and finite values too), alternating the two
so that both see the same page cache, and prints the median time of each.

    python benchmarks/entry_check.py [--repeats 30] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from kvblend.store import DiskKVStore
from kvblend.store.base import EntrySpec


def read_all(store: DiskKVStore, key: str, expect: EntrySpec | None) -> float:
    """Seconds to open `key` and read every tensor (prefetch off: one thread reads)."""
    started = time.perf_counter()
    entry = store.get(key, expect=expect)
    assert entry is not None
    for name in entry:
        entry[name]
    return time.perf_counter() - started


def main() -> None:
    """Measure and print the median read time with and without the check."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shape = (args.heads, args.tokens, args.head_dim)
    names = [f"{kind}.{layer}" for layer in range(args.layers) for kind in "kv"]
    tensors = {name: torch.randn(shape).to(dtype) for name in names}
    expect = EntrySpec(dict.fromkeys(names, (dtype, shape)))
    with tempfile.TemporaryDirectory() as folder:
        store = DiskKVStore(folder, prefetch_ahead=0)
        store.put("entry", tensors, {})
        plain, checked = [], []
        for _ in range(args.repeats):
            plain.append(read_all(store, "entry", None))
            checked.append(read_all(store, "entry", expect))
        store.close()
    size = sum(t.nbytes for t in tensors.values())
    without, with_check = statistics.median(plain), statistics.median(checked)
    print(f"entry: {args.layers} layers x {shape} {args.dtype}, {size / 1e6:.1f} MB")
    print(f"read, checksums only:        {without * 1e3:7.2f} ms")
    print(f"read, + shape/dtype/finite:  {with_check * 1e3:7.2f} ms")
    print(f"check cost: {(with_check - without) * 1e3:+.2f} ms ({with_check / without - 1:+.1%})")


if __name__ == "__main__":
    main()
