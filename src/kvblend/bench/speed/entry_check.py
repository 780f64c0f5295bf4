"""What checking an entry costs: reading a disk entry by checksums, with the model's checks, by MAC.

Writes one realistic entry (30 layers x 3 KV heads x 512 tokens x 64, fp32 by default: 23.6 MB)
into a disk store, and the same entry into a second store that has a store key (entries carry
HMAC-SHA256 tags, `kvblend.store.entry_mac`). Then reads every tensor of it many times: through
``get()`` alone (checksums only), through ``get(expect=...)`` (shape, dtype and finite values
too), and from the keyed store (each tensor verified by its MAC instead of its checksum),
alternating the three so that all see the same page cache, and prints the median of each;
then the fastest time of each hash alone over the entry's bytes.

``--layout per-layer`` stores one tensor per layer and K/V (60 tensors, the layout before
the engine's one-tensor entries); ``--layout kv`` the engine's one ``kv`` tensor
``[layers, 2, kv_heads, tokens, head_dim]``.

    kvblend bench entry-check [--repeats 30] [--dtype float32] [--layout per-layer]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from kvblend.store import DiskKVStore
from kvblend.store.base import EntrySpec
from kvblend.store.entry_format import checksum
from kvblend.store.entry_mac import StoreKey

#: A key for the benchmark's own keyed store (64 hex digits, as `openssl rand -hex 32` gives).
BENCH_KEY = "6b76626c656e642d62656e63686d61726b2d6b65792d6e6f742d612d736563"


def read_all(store: DiskKVStore, key: str, expect: EntrySpec | None) -> float:
    """Seconds to open `key` and read every tensor (prefetch off: one thread reads)."""
    started = time.perf_counter()
    entry = store.get(key, expect=expect)
    assert entry is not None
    for name in entry:
        entry[name]
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    """Measure and print the median read time of each way of checking."""
    parser = argparse.ArgumentParser(
        prog="kvblend bench entry-check", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--layout", default="per-layer", choices=["per-layer", "kv"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    shape = (args.heads, args.tokens, args.head_dim)
    if args.layout == "kv":
        blob = (args.layers, 2, *shape)
        tensors = {"kv": torch.randn(blob).to(dtype)}
        expect = EntrySpec({"kv": (dtype, blob)})
    else:
        names = [f"{kind}.{layer}" for layer in range(args.layers) for kind in "kv"]
        tensors = {name: torch.randn(shape).to(dtype) for name in names}
        expect = EntrySpec(dict.fromkeys(names, (dtype, shape)))
    with tempfile.TemporaryDirectory() as folder:
        store = DiskKVStore(os.path.join(folder, "plain"), prefetch_ahead=0, store_key="")
        keyed = DiskKVStore(os.path.join(folder, "keyed"), prefetch_ahead=0, store_key=BENCH_KEY)
        store.put("entry", tensors, {})
        keyed.put("entry", tensors, {})
        plain, checked, signed = [], [], []
        for _ in range(args.repeats):
            plain.append(read_all(store, "entry", None))
            checked.append(read_all(store, "entry", expect))
            signed.append(read_all(keyed, "entry", None))
        store.close()
        keyed.close()
    size = sum(t.nbytes for t in tensors.values())
    without = statistics.median(plain)
    with_check, with_mac = statistics.median(checked), statistics.median(signed)
    described = f"{args.layers} layers x {shape} {args.dtype} ({args.layout})"
    print(f"entry: {described}, {size / 1e6:.1f} MB")
    print(f"median of {args.repeats} reads, {args.threads} thread(s):")
    print(f"read, checksums only:        {without * 1e3:7.2f} ms")
    print(f"read, + shape/dtype/finite:  {with_check * 1e3:7.2f} ms")
    print(f"read, MACs (HMAC-SHA256):    {with_mac * 1e3:7.2f} ms")
    print(f"check cost: {(with_check - without) * 1e3:+.2f} ms ({with_check / without - 1:+.1%})")
    print(f"MAC cost:   {(with_mac - without) * 1e3:+.2f} ms ({with_mac / without - 1:+.1%})")
    data = b"".join(t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())
    secret = StoreKey(BENCH_KEY.encode())
    for name, digest in (
        ("xxh3-64", checksum),
        ("HMAC-SHA256", lambda b: secret.tensor_tag("", b)),
    ):
        fastest = min(_seconds(digest, data) for _ in range(args.repeats))
        print(
            f"{name + ' alone:':18s} {fastest * 1e3:7.2f} ms ({len(data) / fastest / 1e9:.2f} GB/s)"
        )


def _seconds(digest: Callable[[bytes], str], data: bytes) -> float:
    started = time.perf_counter()
    digest(data)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
