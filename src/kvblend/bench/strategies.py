"""Named prefill strategies compared by the benchmarks, each a `BlendConfig` plus a segment rule.

Names: ``full``, ``default`` (``BlendConfig()``), ``reuse``, ``epic``, ``prefix`` (exact-prefix
reuse: only the cached system prompt is reused and every document is computed, as plain prefix
caching would), ``attention-<ratio>`` such as ``attention-0.2``, and
``cacheblend-<metric>-<ratio>[-L<check layer>]`` such as ``cacheblend-value-0.15`` (check
layer 1) or ``cacheblend-value-0.15-L2``. ``cacheblend`` names are CacheBlend as published,
without kvblend's stale-KV correction; the others use `BlendConfig`'s default correction. A
``-c<share>`` suffix sets it: ``attention-0.2-c0`` (none), ``cacheblend-value-0.2-c0.5``. An
``@compiled`` suffix runs the strategy's prefills through the compiled layer loop
(``KVBLEND_COMPILE=1``), so one run times both loops: ``default,default@compiled``.

Two references measure what rounding alone does to full prefill (`kvblend.bench.quality.rounding`):
``full@bf16-prefill`` is full prefill computed in bfloat16 and decoded in the engine's dtype (the
floor a blend, which changes only the prefill, is read against), ``full@bf16`` computes and decodes
the whole answer in bfloat16. Any strategy takes the ``@bf16`` suffix (``default@bf16``: the blend
a bfloat16 engine runs, decoded in bfloat16) or ``@bf16-prefill``. ``@cached-labels`` lays the
prompt out with each retrieved passage's title label cached with the passage (the prompt's text
is the same): ``default+early_layers=0.25@cached-labels``. Suffixes come after the settings.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvblend.blend.compiled import COMPILE_ENV
from kvblend.blend.config import BlendConfig, parse_setting
from kvblend.prompt.segments import Segment

CACHEBLEND_RATIOS = (0.05, 0.1, 0.15, 0.3)
CACHEBLEND_METRICS = ("value", "key")
ATTENTION_RATIOS = (0.1, 0.15, 0.2, 0.3)


@dataclass(frozen=True)
class Strategy:
    """A benchmarked strategy: its name, its config, and whether documents are cached."""

    name: str
    config: BlendConfig
    cache_documents: bool = True
    compiled: bool = False  # its prefills run the compiled layer loop (``@compiled``)
    #: the prefill run on a bfloat16 copy of the model (`ROUNDED`): ``prefill`` (decoded in the
    #: engine's dtype) or ``answer`` (prefill and decoding in bfloat16); None: the engine's own
    rounding: str | None = None
    #: how the strategy lays out the prompt's segments (`LAYOUTS`); None: as given
    layout: Callable[[Sequence[Segment]], list[Segment]] | None = None

    @contextlib.contextmanager
    def loop(self) -> Iterator[None]:
        """Run the prefills inside in this strategy's layer loop (``KVBLEND_COMPILE``)."""
        if not self.compiled:
            yield
            return
        before = os.environ.get(COMPILE_ENV)
        os.environ[COMPILE_ENV] = "1"
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(COMPILE_ENV, None)
            else:
                os.environ[COMPILE_ENV] = before

    @property
    def recompute_ratio(self) -> float | None:
        """The configured ratio of an ``attention`` or ``cacheblend`` strategy, else None."""
        if self.config.strategy in ("attention", "cacheblend"):
            return self.config.recompute_ratio
        return None

    def segments(self, segments: Sequence[Segment]) -> list[Segment]:
        """Return the prompt as this strategy sees it: documents uncached for ``prefix``."""
        if self.layout is not None:
            segments = self.layout(segments)
        if self.cache_documents:
            return list(segments)
        return [
            s if s.role == "prefix" or not s.cache else Segment(s.text, cache=False)
            for s in segments
        ]


def cache_labels(segments: Sequence[Segment]) -> list[Segment]:
    """Return the prompt with each passage's ``Title: X)`` moved into its cached text.

    The layout ``labels="cached"`` of `kvblend.bench.quality.nq.nq_segments` made from
    ``labels="computed"`` segments: a computed segment ending in a retriever label
    ``...](Title: X)`` right before a cached passage keeps ``...](`` and the passage starts with
    ``Title: X)``. The prompt's text is the same; other segments are left as they are.
    """
    out: list[Segment] = []
    carried = ""
    for segment in segments:
        if carried:  # this passage takes the title of the label before it
            out.append(Segment(carried + segment.text, role=segment.role))
            carried = ""
            continue
        at = segment.text.rfind("](Title: ")
        follows = len(out) + 1 < len(segments)
        if not segment.cache and at >= 0 and segment.text.endswith(")") and follows:
            after = segments[len(out) + 1]
            if after.cache and after.role == "document":
                out.append(Segment(segment.text[: at + 2], cache=False))
                carried = segment.text[at + 2 :]
                continue
        out.append(segment)
    return out


#: Suffixes that lay the prompt out otherwise: ``@cached-labels`` caches each retrieved
#: passage's ``Title: X)`` label with the passage (`cache_labels`).
LAYOUTS: dict[str, Callable[[Sequence[Segment]], list[Segment]]] = {"@cached-labels": cache_labels}
#: Suffixes that run a strategy on a bfloat16 copy of the model: suffix -> what is rounded.
ROUNDED = {"@bf16-prefill": "prefill", "@bf16": "answer"}
#: The floor every closeness figure is read against (prefill-only rounding).
FLOOR = "full@bf16-prefill"


def cacheblend_name(metric: str, ratio: float, check_layer: int = 1) -> str:
    """``cacheblend-<metric>-<ratio>[-L<layer>]``, the ratio written as in ``0.15``."""
    name = f"cacheblend-{metric}-{ratio:g}"
    return name if check_layer == 1 else f"{name}-L{check_layer}"


def strategy(name: str) -> Strategy:
    """Return the `Strategy` called ``name``; ``ValueError`` lists the valid names otherwise.

    Any name takes ``+setting=value`` suffixes that set one `BlendConfig` setting each, such
    as ``attention-0.2+lead_tokens=8``.
    """
    for parse in (_suffixed, _modified, _named, _cacheblend):
        found = parse(name)
        if found is not None:
            return found
    raise ValueError(
        f"unknown strategy {name!r}; use full, default, reuse, epic, prefix, "
        "attention-<ratio> such as attention-0.2 or cacheblend-<value|key>-<ratio>[-L<layer>] "
        f"such as {cacheblend_name('value', 0.15)}, each with an optional -c<correction> suffix"
        " and an @compiled one, a strategy run in bfloat16: full@bf16-prefill, default@bf16, and a "
        "layout: default@cached-labels"
    )


def _suffixed(name: str) -> Strategy | None:
    """Return the strategy a name's ``@`` suffix (layout, bfloat16, compiled loop) makes, if any."""
    for suffix, layout in LAYOUTS.items():
        if name.endswith(suffix):
            found = strategy(name.removesuffix(suffix))
            if found.layout is not None or not found.cache_documents:
                raise ValueError(f"{name}: {suffix} takes a strategy with its own layout")
            return Strategy(
                name, found.config, compiled=found.compiled, rounding=found.rounding, layout=layout
            )
    for suffix, rounding in ROUNDED.items():
        if name.endswith(suffix):
            found = strategy(name.removesuffix(suffix))
            if found.rounding is not None or found.compiled or not found.cache_documents:
                raise ValueError(f"{name}: {suffix} takes a plain strategy")
            return Strategy(name, found.config, rounding=rounding, layout=found.layout)
    if name.endswith("@compiled"):
        found = strategy(name.removesuffix("@compiled"))
        return Strategy(name, found.config, found.cache_documents, compiled=True)
    return None


def _modified(name: str) -> Strategy | None:
    """Return a strategy with ``+setting=value`` settings or a ``-c<share>`` correction, if any."""
    base, *overrides = name.split("+")
    if overrides:
        found = strategy(base)
        changes = dict(parse_setting(text) for text in overrides)
        return Strategy(name, found.config.replace(**changes), found.cache_documents)
    base, _, suffix = name.rpartition("-c")
    share = _ratio(suffix) if base else None
    if share is not None:
        found = strategy(base)
        return Strategy(name, found.config.replace(correction=share), found.cache_documents)
    return None


def _named(name: str) -> Strategy | None:
    """Return ``full``, ``default``, ``reuse``, ``epic``, ``prefix`` or ``attention-<ratio>``."""
    plain = {
        "full": lambda: Strategy(name, BlendConfig("full")),
        "default": lambda: Strategy(name, BlendConfig()),
        "reuse": lambda: Strategy(name, BlendConfig("reuse")),
        "epic": lambda: Strategy(name, BlendConfig("epic")),
        "prefix": lambda: Strategy(name, BlendConfig("reuse"), cache_documents=False),
    }
    if name in plain:
        return plain[name]()
    if name.startswith("attention-"):
        ratio = _ratio(name.removeprefix("attention-"))
        if ratio is not None:
            return Strategy(name, BlendConfig("attention", recompute_ratio=ratio))
    return None


def _cacheblend(name: str) -> Strategy | None:
    """Return ``cacheblend-<metric>-<ratio>[-L<layer>]``: CacheBlend as published, no correction."""
    if not name.startswith("cacheblend-"):
        return None
    parts = name.split("-")
    layer = 1
    if len(parts) == 4 and parts[3][:1] == "L" and parts[3][1:].isdigit():
        layer = int(parts[3][1:])
        parts = parts[:3]
    if len(parts) == 3 and parts[1] in CACHEBLEND_METRICS and layer >= 1:
        ratio = _ratio(parts[2])
        if ratio is not None:
            config = BlendConfig(
                "cacheblend",
                recompute_ratio=ratio,
                deviation=parts[1],
                check_layer=layer,
                correction=0.0,
            )
            return Strategy(name, config)
    return None


def _ratio(text: str) -> float | None:
    """``text`` as a ratio in [0, 1], else None."""
    try:
        ratio = float(text)
    except ValueError:
        return None
    return ratio if 0.0 <= ratio <= 1.0 else None


def all_strategy_names() -> list[str]:
    """Every strategy the full benchmark runs."""
    names = ["full", "prefix"]
    names += [f"attention-{r:g}" for r in ATTENTION_RATIOS]
    names += [cacheblend_name(m, r) for m in CACHEBLEND_METRICS for r in CACHEBLEND_RATIOS]
    return names + ["epic", "reuse"]


def parse_strategies(text: str | Sequence[str]) -> list[Strategy]:
    """Strategies from a comma-separated list (``all`` for every one); ``full`` comes first."""
    names = text.split(",") if isinstance(text, str) else list(text)
    names = [n.strip() for n in names if n.strip()]
    if names == ["all"]:
        names = all_strategy_names()
    if "full" in names:
        names.remove("full")
    return [strategy("full")] + [strategy(n) for n in dict.fromkeys(names)]
