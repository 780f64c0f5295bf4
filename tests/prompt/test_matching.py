"""Finding known documents in finished prompts (pure string logic, no model)."""

from __future__ import annotations

import pytest

from kvblend import Segment
from kvblend.matching import split_prompt


def pieces(segments: list[Segment]) -> list[tuple[str, bool]]:
    return [(s.text, s.cache) for s in segments]


def joined(segments: list[Segment]) -> str:
    return "".join(s.text for s in segments)


TEMPLATE = "Use the context to answer.\n\nContext:\n{context}\n\nQuestion: {question}\nAnswer:"


def test_rag_prompt_joined_with_blank_lines() -> None:
    docs = ["Marta Quill lives in Lisbon.", "Tomas Reed works as a baker."]
    prompt = TEMPLATE.format(context="\n\n".join(docs), question="Where does Marta live?")
    segments = split_prompt(prompt, docs)
    assert pieces(segments) == [
        ("Use the context to answer.\n\nContext:\n", False),
        (docs[0], True),
        ("\n\n", False),
        (docs[1], True),
        ("\n\nQuestion: Where does Marta live?\nAnswer:", False),
    ]
    assert joined(segments) == prompt
    assert all(s.role == "document" for s in segments)


def test_document_with_braces_newlines_and_unicode() -> None:
    doc = 'Config {"a": {b}} uses {{x}}.\nLine two: naïve café — 東京 🚀\n\tTabbed.'
    prompt = f"Before {{braces}}\n{doc}\nAfter ünïcode"
    segments = split_prompt(prompt, [doc])
    assert pieces(segments) == [
        ("Before {braces}\n", False),
        (doc, True),
        ("\nAfter ünïcode", False),
    ]


def test_document_appearing_twice_is_matched_both_times() -> None:
    doc = "The bridge opened in 1931."
    prompt = f"A: {doc} B: {doc} end"
    assert pieces(split_prompt(prompt, [doc])) == [
        ("A: ", False),
        (doc, True),
        (" B: ", False),
        (doc, True),
        (" end", False),
    ]


def test_adjacent_documents_with_nothing_between() -> None:
    first, second = "Alpha is first. ", "Beta comes second."
    prompt = f"Q?{first}{second}"
    assert pieces(split_prompt(prompt, [second, first])) == [
        ("Q?", False),
        (first, True),
        (second, True),
    ]


def test_prompt_that_is_exactly_one_document() -> None:
    doc = "Only a document here."
    assert pieces(split_prompt(doc, [doc])) == [(doc, True)]


def test_user_prefix_before_each_document() -> None:
    docs = ["Oslo is in Norway.", "Quito is in Ecuador."]
    context = "\n".join(f"[Source {i}] {d}" for i, d in enumerate(docs, 1))
    prompt = f"Context:\n{context}\nQuestion: where is Quito?"
    assert pieces(split_prompt(prompt, docs)) == [
        ("Context:\n[Source 1] ", False),
        (docs[0], True),
        ("\n[Source 2] ", False),
        (docs[1], True),
        ("\nQuestion: where is Quito?", False),
    ]


def cached(segments: list[Segment]) -> list[str]:
    return [s.text for s in segments if s.cache]


def test_substring_document_prefers_the_longest_match() -> None:
    short = "Lisbon is sunny."
    long = "Marta lives in Lisbon. Lisbon is sunny."
    prompt = f"{long}\n\n{short}"
    assert pieces(split_prompt(prompt, [short, long])) == [
        (long, True),
        ("\n\n", False),
        (short, True),
    ]


def test_overlapping_documents_keep_the_longer_one() -> None:
    left = "one two three four"
    right = "three four five six seven eight"  # longer, overlaps the end of `left`
    prompt = "one two three four five six seven eight"
    assert pieces(split_prompt(prompt, [left, right])) == [("one two ", False), (right, True)]


def test_equal_length_overlap_keeps_the_earlier() -> None:
    prompt = "abcdefghijklmnop"
    assert cached(split_prompt(prompt, ["efghijklmn", "abcdefghij"])) == ["abcdefghij"]


def test_no_known_document_gives_one_uncached_segment() -> None:
    prompt = "Just a question without context?"
    assert pieces(split_prompt(prompt, ["Not in the prompt at all."])) == [(prompt, False)]
    assert pieces(split_prompt(prompt)) == [(prompt, False)]


def test_short_blank_and_duplicate_documents() -> None:
    """Texts under 8 characters are no documents, as in the registry; duplicates count once."""
    prompt = "x: abcdefgh, y: abcdefgh, z: ab"
    segments = split_prompt(prompt, ["abcdefgh", "abcdefgh", "ab", "", "  ", "\n"])
    assert cached(segments) == ["abcdefgh", "abcdefgh"]
    assert joined(segments) == prompt


def test_document_longer_than_prompt_is_ignored() -> None:
    assert pieces(split_prompt("short one", ["short one and longer"])) == [("short one", False)]


def test_prefix_role_marks_leading_text() -> None:
    doc = "Ana paints murals."
    segments = split_prompt(f"System: be brief.\n{doc}\nWho paints?", [doc], prefix_role=True)
    assert [(s.role, s.cache) for s in segments] == [
        ("prefix", True),
        ("document", True),
        ("document", False),
    ]
    # without a document there is nothing to reuse: no prefix segment
    assert split_prompt("System: be brief.", [doc], prefix_role=True)[0].cache is False


def test_separator_mode_splits_and_drops_the_separator() -> None:
    sep = "# #"
    prompt = f"System text{sep}Doc one.{sep}Doc two.{sep}Question?"
    segments = split_prompt(prompt, separator=sep)
    assert pieces(segments) == [
        ("System text", False),
        ("Doc one.", True),
        ("Doc two.", True),
        ("Question?", False),
    ]
    assert joined(segments) == prompt.replace(sep, "")


def test_separator_mode_edge_cases() -> None:
    assert pieces(split_prompt("no separator here", separator="##")) == [
        ("no separator here", False)
    ]
    # empty pieces (leading separator, doubled separator) are dropped
    assert pieces(split_prompt("##Doc.####Q", separator="##")) == [("Doc.", True), ("Q", False)]
    with pytest.raises(ValueError, match="separator"):
        split_prompt("a##b", separator="")
    with pytest.raises(ValueError, match="nothing but separators"):
        split_prompt("####", separator="##")


def test_separator_mode_ignores_documents() -> None:
    prompt = "Head||Known doc.||Tail"
    assert pieces(split_prompt(prompt, ["Head"], separator="||")) == [
        ("Head", False),
        ("Known doc.", True),
        ("Tail", False),
    ]


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        split_prompt("", ["doc"])


def test_many_known_documents_are_all_found() -> None:
    known = [f"Document number {i} says the value of key {i} is {i * 7}." for i in range(20000)]
    used = [known[17], known[12345], known[19999]]
    filler = "Some template text that is not a document. " * 1000
    prompt = filler + "\n\n".join(used) + "\n\nQuestion: what is key 12345?"
    segments = split_prompt(prompt, known)
    assert [s.text for s in segments if s.cache] == used
    assert joined(segments) == prompt


# ------------------------------------------------------------- vectorised engine matching
def test_window_crc32_is_zlib_crc32_of_every_window() -> None:
    """The registry's anchor hash at every position, vectorised, equals zlib's one by one."""
    import zlib

    from kvblend.documents.anchors import window_crc32

    texts = [
        "a plain ASCII text, long enough for a few windows of sixteen characters",
        "héllo wörld ✓ 日本語 and 🙂 emoji, a lone \ud800 surrogate " * 3,
    ]
    for text in texts:
        for width in (1, 2, 7, 16, 17):
            expected = [
                zlib.crc32(text[i : i + width].encode("utf-8", "surrogatepass"))
                for i in range(len(text) - width + 1)
            ]
            assert window_crc32(text, width).tolist() == expected, width
    assert window_crc32("short", 16).size == 0


def _reference_longest_run(prompt, tokens, char_start, layout):  # type: ignore[no-untyped-def]
    """The plain loop `_longest_run` replaced: first of the longest runs of equal tokens."""
    where: dict[tuple[int, int, int], int] = {}
    for index, (token_id, (start, end)) in enumerate(zip(layout.ids, layout.offsets, strict=True)):
        where.setdefault((token_id, start, end), index)
    best = (0, 0, 0)
    run_start = run_cached = run_length = 0
    for index in tokens:
        start, end = prompt.offsets[index]
        token = (prompt.ids[index], start - char_start, end - char_start)
        expected = run_cached + run_length
        if (
            run_length
            and expected < len(layout.ids)
            and (layout.ids[expected], *layout.offsets[expected]) == token
        ):
            run_length += 1
        else:
            found = where.get(token)
            run_start, run_cached, run_length = index, found or 0, int(found is not None)
        if run_length > best[2]:
            best = (run_start, run_cached, run_length)
    return best


def test_longest_run_matches_the_plain_loop() -> None:
    """Random prompts and layouts: breaks, shifted offsets, repeated ids, no match at all."""
    import random

    from kvblend.prompt.plan import _longest_run
    from kvblend.prompt.tokens import DocumentLayout, PromptTokens

    rng = random.Random(3)
    for _ in range(300):
        length = rng.randint(1, 40)
        ids = [rng.randint(0, 4) for _ in range(length)]
        offsets = [(2 * i, 2 * i + rng.choice((1, 2))) for i in range(length)]
        shift = rng.choice((0, 0, 2, -2))
        cached_ids = [i if rng.random() > 0.15 else rng.randint(0, 4) for i in ids]
        cached_offsets = [(s + shift, e + shift) for s, e in offsets]
        cut = rng.randint(0, length)
        layout = DocumentLayout([], cached_ids[cut:], cached_offsets[cut:])
        prompt = PromptTokens([9, *ids], [(0, 0)] + [(s + 10, e + 10) for s, e in offsets])
        tokens = range(1, length + 1)
        got = _longest_run(prompt, tokens, 10, layout)
        expected = _reference_longest_run(prompt, tokens, 10, layout)
        assert got[2] == expected[2] and (got == expected or not got[2]), (got, expected)


def test_registry_finds_documents_while_and_after_they_are_added() -> None:
    """Searches between additions (each position looked up) and on an unchanged registry
    (sorted anchor arrays) find the same documents."""
    from kvblend.documents.registry import DocumentRegistry

    registry = DocumentRegistry(None, "log")
    texts = [f"Document number {i}: a text long enough to be registered." for i in range(5)]
    prompt = "Head. " + " ".join(texts) + " Question?"
    for count in range(1, 6):
        registry.add(texts[count - 1 : count])
        for _ in range(3):  # changed, then unchanged, then unchanged again
            found = [prompt[m.start : m.end] for m in registry.find(prompt)]
            assert found == texts[:count]
    assert registry.find("nothing known here at all") == []
