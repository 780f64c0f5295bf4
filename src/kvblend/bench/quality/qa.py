"""A multi-document QA task written for kvblend, generated deterministically from a seed.

Every prompt holds three to five documents about fictional people (one-line records, short
profiles and long profiles with filler text); one or two of them hold the facts a question needs,
the others are distractors. Answers are single words or names, so a 135M-parameter model can
answer from full prefill and the score measures what blending loses. Question types:

- ``city``, ``job``, ``pet``, ``employer``: one fact from one document;
- ``who``: "Who lives in <city>?" (find the one document that mentions the city);
- ``choice``: "Which of X and Y lives in <city>?" (compare two documents);
- ``bridge``: "What is the job of the person who lives in <city>?" (link two facts);
- ``same_city``: "Do X and Y live in the same city?" (yes/no over two documents).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

SYSTEM_PROMPT = "Answer the question using the documents. Give a short answer."

FIRST_NAMES = (
    "Alice", "Bruno", "Clara", "Daniel", "Elena", "Felix", "Grace", "Hugo", "Irene", "Jonas",
    "Karen", "Leo", "Maria", "Nathan", "Olga", "Pablo", "Rosa", "Simon", "Tina", "Victor",
    "Wanda", "Oscar", "Nina", "Igor", "Laura", "Martin", "Sofia", "Peter", "Emma", "David",
)  # fmt: skip
LAST_NAMES = (
    "Brown", "Novak", "Garcia", "Keller", "Rossi", "Smith", "Jensen", "Moreau", "Silva", "Weber",
    "Kowalski", "Larsen", "Fischer", "Costa", "Meyer", "Dubois", "Horvat", "Bauer", "Wagner",
    "Ortiz", "Fernandez", "Nilsson", "Petrov", "Schmidt", "Hansen", "Murphy", "Clarke", "Lopez",
)  # fmt: skip
CITIES = (
    "Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Berlin", "Madrid", "Rome", "Dublin", "Vienna",
    "Prague", "Lisbon", "Athens", "Warsaw", "Boston", "Denver", "Sydney", "Toronto", "Chicago",
    "London", "Moscow", "Seoul", "Mumbai", "Nairobi", "Havana", "Miami", "Zurich", "Helsinki",
)  # fmt: skip
JOBS = (
    "baker", "teacher", "nurse", "pilot", "farmer", "painter", "doctor", "lawyer", "chef",
    "dentist", "plumber", "writer", "singer", "engineer", "architect", "journalist", "firefighter",
    "carpenter", "librarian", "photographer",
)  # fmt: skip
PETS = ("cat", "dog", "parrot", "rabbit", "horse", "turtle", "hamster", "goldfish", "snake", "goat")
EMPLOYERS = (
    "Northwind", "Bluepeak", "Redstone", "Silverline", "Greenfield", "Ironbridge", "Sunvale",
    "Oakridge", "Brightwater", "Stormcliff", "Goldcrest", "Maplewood", "Clearsky", "Deepriver",
)  # fmt: skip
HOBBIES = (
    "chess", "tennis", "cooking", "hiking", "gardening", "swimming", "knitting", "cycling",
    "fishing", "dancing", "reading", "running",
)  # fmt: skip
FILLER = (
    "On weekends {first} likes {hobby} and long walks.",
    "{first} drinks coffee every morning before work.",
    "Friends describe {first} as calm, patient and kind.",
    "Last summer {first} spent two weeks at the sea.",
    "{first} keeps a small garden with tomatoes and herbs.",
    "{first} reads the news every evening.",
    "Every year {first} visits family in the countryside.",
    "{first} once ran a half marathon in the rain.",
    "{first} collects old postcards and maps.",
    "The neighbours often see {first} cycling to the market.",
    "{first} learned to play the piano as a child.",
    "{first} prefers tea in the afternoon.",
)

DOC_STYLES = ("record", "profile", "long")
QUESTION_TYPES = ("city", "job", "pet", "employer", "who", "choice", "bridge", "same_city")


@dataclass(frozen=True)
class Person:
    """The facts of one fictional person."""

    first: str
    last: str
    city: str
    job: str
    pet: str
    employer: str
    year: int
    hobby: str

    @property
    def name(self) -> str:
        """Full name."""
        return f"{self.first} {self.last}"


@dataclass
class QAItem:
    """One question over a set of documents, with the answers that count as correct.

    Attributes:
        qid: stable id, ``"<set>-<n>"``.
        qtype: one of `QUESTION_TYPES`.
        question: the question text.
        documents: the documents in prompt order.
        answers: accepted answers (any one contained in the normalised prediction is correct).
        wrong: strings whose presence makes a prediction wrong (the other option of a choice).
        evidence: indexes of the documents that hold the facts the answer needs.
    """

    qid: str
    qtype: str
    question: str
    documents: list[str]
    answers: list[str]
    wrong: list[str] = field(default_factory=list)
    evidence: list[int] = field(default_factory=list)
    answer_prefix: str = ""

    def to_dict(self) -> dict:
        """Plain-JSON form."""
        return asdict(self)


def render_document(person: Person, style: str, rng: random.Random) -> str:
    """Return the text of one document about ``person`` in a given style."""
    p = person
    if style == "record":
        return f"{p.name} lives in {p.city} and works as a {p.job}."
    pronoun = rng.choice(("He", "She"))
    facts = [
        f"{p.name} lives in {p.city}.",
        f"{pronoun} works as a {p.job} at {p.employer}.",
        f"{pronoun} has a pet {p.pet}.",
        f"{pronoun} was born in {p.year}.",
    ]
    if style == "profile":
        return " ".join(facts)
    fillers = rng.sample(FILLER, 6)
    text = [facts[0]]
    for index, filler in enumerate(fillers):
        text.append(filler.format(first=p.first, hobby=p.hobby))
        if index < len(facts) - 1:
            text.append(facts[index + 1])
    return " ".join(text)


def _people(rng: random.Random, count: int) -> list[Person]:
    """``count`` people with distinct names, cities, jobs, pets and employers."""
    firsts = rng.sample(FIRST_NAMES, count)
    lasts = rng.sample(LAST_NAMES, count)
    cities = rng.sample(CITIES, count)
    jobs = rng.sample(JOBS, count)
    pets = rng.sample(PETS, count)
    employers = rng.sample(EMPLOYERS, count)
    return [
        Person(f, la, c, j, p, e, rng.randint(1950, 2000), rng.choice(HOBBIES))
        for f, la, c, j, p, e in zip(firsts, lasts, cities, jobs, pets, employers, strict=True)
    ]


def _name_answers(person: Person) -> list[str]:
    return [person.first, person.last]


#: (type, question, answers, wrong answers, evidence document indices, answer prefix)
_Question = tuple[str, str, list[str], list[str], list[int], str]


def _questions(people: list[Person], styles: list[str], rng: random.Random) -> list[_Question]:
    """Candidate questions over one document set: (type, question, answers, wrong, evidence)."""
    out: list[_Question] = []
    n = len(people)
    i, j = rng.sample(range(n), 2)
    a, b = people[i], people[j]
    out.append(
        ("city", f"In which city does {a.name} live?", [a.city], [], [i], f"{a.name} lives in")
    )
    out.append(("job", f"What is the job of {a.name}?", [a.job], [], [i], f"{a.name} works as a"))
    out.append(
        (
            "who",
            f"Who lives in {b.city}?",
            _name_answers(b),
            [],
            [j],
            f"The person who lives in {b.city} is",
        )
    )
    out.append(
        (
            "choice",
            f"Which of {a.name} and {b.name} lives in {a.city}?",
            _name_answers(a),
            _name_answers(b),
            [i, j],
            f"Of the two, the one who lives in {a.city} is",
        )
    )
    out.append(
        (
            "bridge",
            f"What is the job of the person who lives in {b.city}?",
            [b.job],
            [],
            [j],
            f"The person who lives in {b.city} works as a",
        )
    )
    rich = [k for k in range(n) if styles[k] != "record"]
    if rich:
        k = rng.choice(rich)
        c = people[k]
        out.append(
            ("pet", f"What pet does {c.name} have?", [c.pet], [], [k], f"{c.name} has a pet")
        )
        out.append(
            (
                "employer",
                f"Which company does {c.name} work for?",
                [c.employer],
                [],
                [k],
                f"{c.name} works at",
            )
        )
    return out


def _same_city(people: list[Person], rng: random.Random) -> tuple[list[Person], _Question]:
    """Make a yes/no question about two people; for "yes" the second moves to the first's city."""
    i, j = rng.sample(range(len(people)), 2)
    same = rng.random() < 0.5
    if same:
        moved = people[j]
        people = list(people)
        people[j] = Person(
            moved.first,
            moved.last,
            people[i].city,
            moved.job,
            moved.pet,
            moved.employer,
            moved.year,
            moved.hobby,
        )
    a, b = people[i], people[j]
    question = f"Do {a.name} and {b.name} live in the same city? Answer yes or no."
    return people, ("same_city", question, ["yes" if same else "no"], [], [i, j], "Answer:")


def generate_qa(
    num_questions: int = 240,
    seed: int = 0,
    docs_per_prompt: tuple[int, int] = (3, 5),
    questions_per_set: int = 3,
    styles: Sequence[str] = DOC_STYLES,
) -> list[QAItem]:
    """Generate the QA task: ``num_questions`` items, cycling through the question types.

    The same arguments always give the same items (a private ``random.Random(seed)``).
    Documents are shared by the questions of a set, so each is precomputed once.
    """
    rng = random.Random(seed)
    items: list[QAItem] = []
    set_index = 0
    type_cycle = 0
    while len(items) < num_questions:
        count = rng.randint(*docs_per_prompt)
        people = _people(rng, count)
        doc_styles = [rng.choice(list(styles)) for _ in range(count)]
        wanted = [
            QUESTION_TYPES[(type_cycle + k) % len(QUESTION_TYPES)] for k in range(questions_per_set)
        ]
        type_cycle += questions_per_set
        same_city = None
        if "same_city" in wanted:
            people, same_city = _same_city(people, rng)
        documents = [render_document(p, s, rng) for p, s in zip(people, doc_styles, strict=True)]
        candidates = {q[0]: q for q in _questions(people, doc_styles, rng)}
        if same_city is not None:
            candidates["same_city"] = same_city
        number = 0
        for qtype in wanted:
            chosen = candidates.get(qtype) or candidates[rng.choice(["city", "job", "who"])]
            if chosen[0] in ("who", "choice", "bridge") and same_city is not None:
                chosen = candidates["job"]  # a shared city would make these ambiguous
            kind, question, answers, wrong, evidence, prefix = chosen
            items.append(
                QAItem(
                    f"{set_index}-{number}",
                    kind,
                    question,
                    documents,
                    answers,
                    wrong,
                    evidence,
                    prefix,
                )
            )
            number += 1
            if len(items) == num_questions:
                break
        set_index += 1
    return items


# ---------------------------------------------------------------------- scoring
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = re.compile(r"[^\w\s]")


def normalize(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace."""
    text = _PUNCT.sub(" ", text.lower())
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _contains(haystack: str, needle: str) -> bool:
    needle = normalize(needle)
    return bool(needle) and re.search(rf"\b{re.escape(needle)}\b", haystack) is not None


def score(prediction: str, answers: Sequence[str], wrong: Sequence[str] = ()) -> bool:
    """Return True if the normalised prediction contains an accepted answer and no wrong option.

    Yes/no answers must be the prediction's first word.
    """
    text = normalize(prediction)
    if any(normalize(a) in ("yes", "no") for a in answers):
        return text.split()[:1] == [normalize(answers[0])]
    if any(_contains(text, w) for w in wrong):
        return False
    return any(_contains(text, a) for a in answers)
