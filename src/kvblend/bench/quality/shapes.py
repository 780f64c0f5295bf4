"""Blend quality on every prompt shape in one report, engines told and not told the head.

Quality depends on the prompt's shape: how many documents, how long, labelled or not. One run
measures each shape on the same model, with the same strategies, each twice: with an engine
told the prompts' exact head (documents precomputed behind it) and with an engine left at its
defaults. Shapes:

- ``nq-5``, ``nq-10``, ``nq-20``: NQ-open over k retrieved Wikipedia passages (116 tokens
  on average), labelled ``Document [i](Title: ...)`` (`kvblend.bench.quality.nq`);
- ``qa``: the project's generated QA task (`kvblend.bench.quality.qa`, 3-5 records and profiles);
- ``records``: the QA generator's one-line records only, 4-6 per prompt (11-16 tokens each);
- ``long``: NQ with the top 12 passages joined four at a time into three long documents
  (~500 tokens on average, one label per document, the gold passage in one of them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvblend.bench.quality.compare import PromptItem, engines_for, run_items, summarize_rows
from kvblend.bench.quality.nq import Retriever, load_nq, nq_items, write_json
from kvblend.bench.quality.qa import SYSTEM_PROMPT, generate_qa, score
from kvblend.bench.quality.qa_bench import prompt_segments
from kvblend.bench.strategies import Strategy
from kvblend.engine.engine import BlendEngine

SHAPES = ("nq-5", "nq-10", "nq-20", "qa", "records", "long")
#: Answer tokens per shape: the QA task's answers are a word or two after an answer prefix.
MAX_NEW_TOKENS = {"qa": 12, "records": 12}
LONG_PASSAGES, LONG_GROUP = 12, 4


def parse_shapes(text: str) -> list[str]:
    """Shapes from a comma list (``all``: every one), in the order given."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise ValueError(f"unknown shape(s) {unknown}; use {', '.join(SHAPES)} or all")
    return list(dict.fromkeys(names))


def qa_items(engine: BlendEngine, shape: str, questions: int, seed: int) -> list[PromptItem]:
    """Prompt items of the QA task (``qa``) or of its one-line records alone (``records``)."""
    if shape == "records":
        generated = generate_qa(questions, seed=seed, docs_per_prompt=(4, 6), styles=("record",))
    else:
        generated = generate_qa(questions, seed=seed)
    return [
        PromptItem(
            qid=f"{shape}-{item.qid}",
            segments=prompt_segments(engine, item, SYSTEM_PROMPT),
            answers=item.answers,
            score=functools.partial(score, answers=item.answers, wrong=item.wrong),
            meta={"qtype": item.qtype},
        )
        for item in generated
    ]


def shape_items(
    engine: BlendEngine,
    shape: str,
    questions: int,
    seed: int,
    nq: Callable[[], tuple[Any, Any, Retriever]],
    gold_at: str = "retrieved",
) -> list[PromptItem]:
    """Prompt items of one shape; ``nq()`` returns (corpus, questions, retriever), loaded once."""
    if shape in ("qa", "records"):
        return qa_items(engine, shape, questions, seed)
    corpus, nq_questions, retriever = nq()
    if shape == "long":
        return nq_items(
            engine,
            corpus,
            nq_questions[:questions],
            retriever,
            k=LONG_PASSAGES,
            seed=seed,
            group=LONG_GROUP,
            gold_at=gold_at,
        )
    k = int(shape.removeprefix("nq-"))
    return nq_items(
        engine, corpus, nq_questions[:questions], retriever, k=k, seed=seed, gold_at=gold_at
    )


def run_shapes(
    base: BlendEngine,
    shapes: Sequence[str],
    strategies: Sequence[Strategy],
    *,
    data: str | Path | None,
    questions: int = 40,
    seed: int = 0,
    gold_at: str = "retrieved",
    max_new_tokens: int = 32,
    heads: Sequence[str] = ("told", "untold"),
    cache_dir: Path | None = None,
    output: Path | None = None,
    meta: dict[str, Any] | None = None,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Every strategy on ``questions`` questions of each shape, under each head."""
    nq = NQData(data, cache_dir=cache_dir)
    result: dict[str, Any] = {
        "benchmark": "shapes",
        **(meta or {}),
        "data": str(data) if data else None,
        "questions_per_shape": questions,
        "seed": seed,
        "gold_at": gold_at,
        "shapes": list(shapes),
        "strategies": [s.name for s in strategies],
        "heads": {},
        "summary": [],
        "rows": [],
    }

    def checkpoint(earlier: list[Any], rows: list[dict[str, Any]]) -> None:
        result["rows"] = earlier + rows
        result["summary"] = summarize_rows(result["rows"], group_by=("shape", "head"), seed=seed)
        write_json(result, output)

    done: list[dict[str, Any]] = []
    for shape in shapes:
        items = shape_items(base, shape, questions, seed, nq, gold_at)
        engines = _shape_engines(base, shape, items, heads)
        result["heads"][shape] = {name: engine.doc_prefix for name, engine in engines.items()}
        if log is not None:
            log(f"shape {shape}: {len(items)} questions")
        done += run_items(
            engines,
            items,
            strategies,
            log=log,
            checkpoint=functools.partial(checkpoint, list(done)),
            max_new_tokens=MAX_NEW_TOKENS.get(shape, max_new_tokens),
        )
    return result


def _shape_engines(
    base: BlendEngine, shape: str, items: list[PromptItem], heads: Sequence[str]
) -> dict[str, BlendEngine]:
    """Return the engines of ``heads`` for the shape's one prompt head; mark its items."""
    head = items[0].head
    if any(item.head != head for item in items):
        raise RuntimeError(f"the prompts of shape {shape} do not share one head")
    engines = engines_for(base, heads, head)
    for item in items:
        item.meta["shape"] = shape
    return engines


class NQData:
    """The NQ data file's corpus, questions and retriever, loaded when a shape first needs them.

    ``shapes`` names the shapes that need it in the error a missing ``--data`` raises.
    """

    def __init__(
        self,
        data: str | Path | None,
        *,
        cache_dir: Path | None = None,
        shapes: str = "nq-* and long",
    ) -> None:
        self.data, self.cache_dir, self.shapes = data, cache_dir, shapes
        self.loaded: tuple[Any, Any, Retriever] | None = None

    def __call__(self) -> tuple[Any, Any, Retriever]:
        """Return the corpus, the questions and the retriever over the corpus."""
        if self.data is None:
            raise ValueError(f"the {self.shapes} shapes need the NQ data file (--data)")
        if self.loaded is None:
            corpus, nq_questions = load_nq(self.data)
            retriever = Retriever(corpus, data_path=self.data, cache_dir=self.cache_dir)
            self.loaded = (corpus, nq_questions, retriever)
        return self.loaded
