"""FlexAttention over a pass's computed rows, its block mask built on the device.

The computed rows are sorted positions; query ``i`` (at position ``rows[i]``) may attend to keys
``<= rows[i]`` (and ``> rows[i] - window`` on a sliding-window layer). FlexAttention takes that
mask as a `BlockMask`: for every block of `BLOCK` queries, the key blocks it must visit, split
into *full* blocks (every query of the block sees every key of it: no mask evaluated) and
*partial* ones (the ``mask_mod`` decides per element). Because the rows are sorted, a query
block's visible keys are one range, from its first row's window start to its last row, so
both sets are ranges of key blocks, computed with a handful of device ops from each block's
first and last position (`block_mask`): nothing is read back to the host and no dense mask is
made (``create_block_mask`` evaluates the mask over every element instead: about a second
eagerly for a 4K prompt). The ``mask_mod`` reads the rows from a tensor, so a new prompt of the
same sizes reuses a compiled kernel.

Outside a compiled step (the eager loop on CUDA) the kernel is compiled per shape, so shapes
are made few, whatever the prompts: the K/V buffer is a `key_bucket` long (a power of two) and
the queries are padded to a `query_bucket` (an eighth, a quarter, half or all of it) by blocks that
visit no key and are written nowhere. Prompts from 512 to 16K tokens then need at most 20
kernels (5 key buckets x 4), about 10 in practice (the probe's rows and the main pass's).
A compile refused for a shape (dynamo's recompile limit, a lowering or codegen the backend
refuses, anything the kernel's first run raises) is never silent and never reaches the
caller: the call returns None, the caller attends by query chunks instead, and
`COMPILE_REFUSALS` logs it once and counts it (`CompileRefusals`: that shape is not compiled
again).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Queries and keys per block of the block mask (FlexAttention's default).
BLOCK = 128

#: The fewest keys of a buffer that the compiled kernel reads outside a compiled step.
MIN_KEYS = 1024

#: Device types where FlexAttention runs as a compiled kernel outside a compiled step (on the
#: CPU it would run eagerly, materialising every score: the eager CPU loop uses query chunks).
#: Tests add ``"cpu"`` to run CUDA's path through the CPU's inductor.
COMPILED_DEVICES = {"cuda"}

#: Kernels dynamo may keep of the compiled FlexAttention: one per shape in use (`key_bucket`
#: x `query_bucket`, per window size, dtype and head layout), far fewer than this.
FLEX_RECOMPILE_LIMIT = 256


def size_bucket(n: int) -> int:
    """Round ``n`` up to a size bucket: a multiple of `BLOCK`, ``m * 2**k`` with ``m`` in 4..7.

    At most a quarter more than ``n`` (an eighth on average), four buckets per doubling: the
    shapes a compiled kernel (or loop) is made for.
    """
    blocks = -(-max(n, 1) // BLOCK)
    if blocks <= 4:
        return blocks * BLOCK
    shift = blocks.bit_length() - 3  # keep the top three bits
    return ((blocks + (1 << shift) - 1) >> shift << shift) * BLOCK


def key_bucket(n: int) -> int:
    """Keys of the K/V buffer of an ``n``-token prompt read by the compiled kernel.

    A power of two, at least `MIN_KEYS`: key blocks past the prompt are never visited (the
    block mask stops at each query block's last row), so only memory pays for the padding.
    """
    return max(MIN_KEYS, 1 << (max(n, 1) - 1).bit_length())


def query_bucket(count: int, keys: int) -> int:
    """Query rows of the kernel for ``count`` rows over ``keys`` keys (a `key_bucket`).

    ``keys`` / 8, / 4, / 2 or ``keys`` itself, the smallest that holds ``count``: at most four
    kernels per key bucket, two in practice (sparse rows are under half the prompt). Query
    blocks past the rows visit no key block, so they cost a launch and no attention.
    """
    for shift in (3, 2, 1, 0):
        size = -(-max(keys >> shift, 1) // BLOCK) * BLOCK  # whole blocks
        if count <= size:
            return size
    return -(-count // BLOCK) * BLOCK


def _blocks(x: torch.Tensor) -> torch.Tensor:
    return torch.div(x, BLOCK, rounding_mode="floor")


def block_ranges(
    first: torch.Tensor, last: torch.Tensor, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Key-block ranges of query blocks whose rows span positions ``first..last`` (each).

    Returns ``(low, high, full_low, full_high)``: the blocks visited are ``low..high``
    (inclusive), of which ``full_low..full_high - 1`` are full (an empty range when equal).
    """
    high = _blocks(last)
    full_high = torch.minimum(_blocks(first + 1), high + 1)  # blocks wholly at or before first
    if window is None:
        low = torch.zeros_like(first)
        full_low = low
    else:
        low = _blocks((first - window + 1).clamp(min=0))
        full_low = torch.maximum(_blocks((last - window + 1).clamp(min=0) + BLOCK - 1), low)
    full_high = torch.maximum(full_high, full_low)
    return low, high, full_low, full_high


def block_mask_data(
    padded: torch.Tensor, key_blocks: int, window: int | None, used: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices`` of sorted rows.

    ``padded``: the rows' positions, their count a multiple of `BLOCK` (padding repeats a
    position at or after the last row's). Each ``[1, 1, query blocks(, key_blocks)]`` int32.
    ``used``: query blocks from this one on hold padding only and visit no key block.
    """
    blocks = padded.view(-1, BLOCK)
    low, high, full_low, full_high = block_ranges(blocks[:, 0], blocks[:, -1], window)
    full = full_high - full_low
    before = full_low - low  # partial blocks before the full ones (window edge)
    partial = high + 1 - low - full
    step = torch.arange(key_blocks, device=padded.device).unsqueeze(0)
    # partial blocks: low .. full_low - 1, then full_high .. high
    indices = torch.where(
        step < before.unsqueeze(1),
        low.unsqueeze(1) + step,
        (full_high - before).unsqueeze(1) + step,
    )
    full_indices = full_low.unsqueeze(1) + step

    def shaped(x: torch.Tensor, most: int) -> torch.Tensor:
        return x.clamp(0, most).to(torch.int32)[None, None]

    last = key_blocks - 1  # indices past a query block's count are never read: any block
    partial, full = shaped(partial, key_blocks), shaped(full, key_blocks)
    if used is not None and used < blocks.shape[0]:
        partial[..., used:] = 0
        full[..., used:] = 0
    return partial, shaped(indices, last), full, shaped(full_indices, last)


def row_mask_mod(rows: torch.Tensor, window: int | None) -> Any:
    """Return the rows' exact mask as a ``mask_mod``: key ``<= rows[query]`` (in the window)."""

    def causal(batch: Any, head: Any, query: Any, key: Any) -> Any:
        allowed = key <= rows[query]
        return allowed if window is None else allowed & (key > rows[query] - window)

    return causal


def pad_rows(rows: torch.Tensor, size: int) -> torch.Tensor:
    """``rows`` followed by copies of its last position, ``size`` in all (device ops only)."""
    extra = size - rows.numel()
    return rows if extra == 0 else torch.cat((rows, rows[-1:].expand(extra)))


def compiled_flex(device: torch.device) -> bool:
    """Whether FlexAttention on ``device`` runs as the compiled kernel outside a compiled step."""
    return device.type in COMPILED_DEVICES


@functools.cache
def _compiled_flex() -> Any:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False, fullgraph=True)


def limit_errors() -> tuple[type[BaseException], ...]:
    """Dynamo's error for a compile refused by its recompile limit (named by torch version)."""
    exc = torch._dynamo.exc
    names = ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
    return tuple(getattr(exc, name) for name in names if hasattr(exc, name))


#: Modules whose errors are the compiler's own (dynamo's tracing and limits, a backend's
#: lowering or codegen, fake-tensor propagation): raised before the graph runs.
COMPILER_MODULES = ("torch._dynamo", "torch._inductor", "torch._subclasses", "torch._functorch")


def compiler_error(error: BaseException) -> bool:
    """Whether ``error`` was raised by the compiler (before its graph ran), not by running it."""
    return isinstance(error, limit_errors()) or any(
        type(error).__module__.startswith(module) for module in COMPILER_MODULES
    )


#: Runs of a bucket until it is trusted, by device type: before, any error of a compiled call
#: is taken as the compiler's refusal. CUDA graphs are recorded at a graph's second run (the
#: first warms up), so there the second run must pass too; elsewhere the first runs the code.
PROVEN_RUNS = {"cuda": 2}


def reason(error: BaseException) -> str:
    """One line saying why a compile was refused: the error's type and message, cut short."""
    text = " ".join(str(error).split())
    text = text if len(text) <= 300 else text[:299] + "…"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class CompileRefusals:
    """Compiles the backend refused, by bucket: each kind said once in the log, every call counted.

    A bucket is what one compiled graph (or kernel) serves: the shapes and flags it is traced
    with. The first runs of a bucket (`PROVEN_RUNS`) may raise whatever compiling raises
    (dynamo's recompile limit, a lowering or codegen the backend refuses, a torch version that
    lacks something) or the compiled code's first run raises; `run` then takes the bucket as
    refused: that call and every later one of the bucket run uncompiled, without trying to
    compile it again. A bucket that ran is trusted: an error of a later run reaches the caller
    unless the compiler raised it (a new graph, refused before it ran).
    """

    def __init__(self) -> None:
        self.refused = 0  # calls run uncompiled because their bucket's compile was refused
        self.buckets: dict[Hashable, str] = {}  # refused bucket -> why
        self._runs: dict[tuple[Hashable, Hashable], int] = {}  # runs of (bucket, part) so far
        self._said: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def run(
        self,
        what: str,
        bucket: Hashable,
        call: Callable[[], _T],
        proven: int = 1,
        keep: Callable[[], Callable[[], Any]] | None = None,
        part: Hashable = None,
    ) -> _T | None:
        """Return ``call()`` (a compiled call of ``bucket``), or None when its compile is refused.

        None: the caller runs the same work uncompiled. ``proven``: runs before the bucket is
        trusted, counted per ``part`` (a layer: CUDA graphs record one per layer). ``keep``:
        called before an untrusted run, returns what restores the inputs that the call writes
        in place, so a run that fails halfway leaves them as they were.
        """
        if bucket in self.buckets:
            with self._lock:
                self.refused += 1
            return None
        runs = self._runs.get((bucket, part), 0)
        trusted = runs >= proven
        restore = keep() if keep is not None and not trusted else None
        try:
            out = call()
        except Exception as error:
            if trusted and not compiler_error(error):
                raise
            if restore is not None:
                restore()
            self.hit(what, bucket, error)
            return None
        if not trusted:
            with self._lock:
                self._runs[bucket, part] = runs + 1
        return out

    def hit(self, what: str, bucket: Hashable, error: BaseException) -> None:
        """Refuse ``bucket`` (its compile raised ``error``): counted, each kind logged once."""
        why = reason(error)
        kind = (what, type(error).__name__)
        with self._lock:
            self.refused += 1
            self.buckets[bucket] = why
            first = kind not in self._said
            self._said.add(kind)
        if first:
            logger.warning(
                "%s: the compiler refused it (%s); that shape runs uncompiled from now on "
                "(and any other shape refused the same way, said here once), counted in "
                "stats.uncompiled_calls",
                what,
                why,
            )


#: The process's refused compiles (FlexAttention and the compiled layer step).
COMPILE_REFUSALS = CompileRefusals()


def run_compiled_flex(window: int | None, *args: Any, **kwargs: Any) -> torch.Tensor | None:
    """Return the compiled kernel's ``flex_attention(*args, **kwargs)``; None if refused a compile.

    ``window``: the sliding window of the block mask's ``mask_mod`` (a constant of the kernel).

    ``fullgraph=True`` makes dynamo raise where it would otherwise run the unfused eager
    function (which materialises every score) in silence. A shape whose compile (or first
    run) raised is refused (`COMPILE_REFUSALS`): the caller attends another way. The kernel
    writes nothing in place, so a failed run changes nothing.
    """
    config: Any = torch._dynamo.config
    limits = {
        "recompile_limit": FLEX_RECOMPILE_LIMIT,
        "accumulated_recompile_limit": FLEX_RECOMPILE_LIMIT,
    }

    def call() -> torch.Tensor:
        with config.patch(limits):
            return _compiled_flex()(*args, **kwargs)

    query = args[0]
    bucket = ("flex", query.device.type, query.dtype, *(tuple(x.shape) for x in args[:3]), window)
    proven = PROVEN_RUNS.get(query.device.type, 1)
    return COMPILE_REFUSALS.run("FlexAttention", bucket, call, proven)


class FlexRows:
    """The computed rows' attention in one FlexAttention call per layer, masks built once.

    ``rows`` are the sorted positions (on the device), ``keys`` the rows of the layer's K/V it
    is given; one block mask per window size of the model, reused by every layer of the pass.
    Inside a compiled step (``padded``: its rows are a size bucket's already) the queries are
    taken as they are; elsewhere they are padded to a `query_bucket` by blocks that visit no
    key, so the compiled kernel serves every prompt of a (key, query) bucket pair.
    """

    def __init__(
        self,
        rows: torch.Tensor,
        keys: int,
        windows: set[int | None],
        scaling: float,
        padded: bool = False,
    ) -> None:
        self.count = rows.numel()
        self.keys = keys
        self.scaling = scaling
        size = self.count if padded else query_bucket(self.count, keys)
        self.padded = pad_rows(rows, size)
        used = None if padded else -(-self.count // BLOCK)
        key_blocks = -(-keys // BLOCK)
        self.data = {
            window: block_mask_data(self.padded, key_blocks, window, used) for window in windows
        }

    def block_mask(self, window: int | None) -> Any:
        """Return the `BlockMask` of ``window`` (a plain object over this pass's tensors)."""
        from torch.nn.attention.flex_attention import BlockMask

        partial, indices, full, full_indices = self.data[window]
        return BlockMask.from_kv_blocks(
            partial,
            indices,
            full,
            full_indices,
            BLOCK_SIZE=BLOCK,
            mask_mod=row_mask_mod(self.padded, window),
            seq_lengths=(self.padded.numel(), self.keys),
            compute_q_blocks=False,
        )

    def __call__(
        self, window: int | None, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor | None:
        """Attention ``[rows, heads * head_dim]`` of rotated ``queries`` over the layer's K/V.

        None when the compiled kernel was refused a compile for this shape (then the caller
        attends another way).
        """
        padding = self.padded.numel() - self.count
        if padding:
            queries = torch.cat((queries, queries[:, -1:].expand(-1, padding, -1)), dim=1)
        args = (queries.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0))
        options = {
            "block_mask": self.block_mask(window),
            "scale": self.scaling,
            "enable_gqa": queries.shape[0] != keys.shape[0],
        }
        if torch.compiler.is_compiling() or not compiled_flex(keys.device):
            from torch.nn.attention.flex_attention import flex_attention

            out = flex_attention(*args, **options)  # traced into a compiled step, or eager
        else:
            out = run_compiled_flex(window, *args, **options)
            if out is None:
                return None
        return out[0, :, : self.count].transpose(0, 1).reshape(self.count, -1)
