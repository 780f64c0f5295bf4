"""Chat-formatted RAG prompts: the model's chat template around documents and a question.

A RAG prompt built here is ``[template head + system prompt + "Documents:"][doc][sep][doc]...
[sep + "Question: ..." + template tail]``. The head is the text every document is precomputed
behind by default (`rag_prefix`), so the document placed first in such a prompt is reused
exactly and the others follow the kind of text they were computed behind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvblend.prompt.segments import Segment
from kvblend.validation import check_text, check_texts

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "apply_chat_template",
    "chat_head_tail",
    "rag_prefix",
    "rag_segments",
]

#: System prompt of the RAG prompts built when none is given (`BlendEngine.rag_segments`, the
#: vLLM connector's document context), and so part of the default document context.
DEFAULT_SYSTEM_PROMPT = "Answer the question using only the documents."

_SENTINEL = "\ue000"


def apply_chat_template(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> str:
    """Render the tokenizer's chat template over ``messages``, ready for the assistant's turn.

    A tokenizer without a chat template gets ``role: content`` lines and ``assistant:``.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
            f"{type(messages).__name__}"
        )
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TypeError(
                f"messages[{index}] must be a dict with a str 'role', got {message!r:.60}"
            )
    if getattr(tokenizer, "chat_template", None) is None:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + "\nassistant:"
    rendered = tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=True
    )
    return str(rendered)


def chat_head_tail(tokenizer: Any, system: str | None) -> tuple[str, str]:
    """Return the chat template's text before and after a user message (and ``system``)."""
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": _SENTINEL}
    ]
    head, tail = apply_chat_template(tokenizer, messages).split(_SENTINEL)
    return head, tail


def rag_prefix(tokenizer: Any, system: str | None, separator: str = "\n\n") -> str:
    """Return the head of the prompts `rag_segments` builds, up to the first document."""
    return chat_head_tail(tokenizer, system)[0] + "Documents:" + separator


def rag_segments(
    tokenizer: Any,
    question: str,
    documents: Sequence[str],
    *,
    system: str | None,
    separator: str = "\n\n",
) -> list[Segment]:
    """Return the segments of a chat RAG prompt: template head, documents, question."""
    check_text(question, "the question")
    if not question.strip():
        raise ValueError("the question is empty")
    documents = check_texts(documents, "documents")
    if system is not None:
        check_text(system, "system")
    if not check_text(separator, "separator"):
        raise ValueError("the separator is empty")
    for index, document in enumerate(documents):
        if not document:
            raise ValueError(f"documents[{index}] is empty")
    head, tail = chat_head_tail(tokenizer, system)
    segments = [Segment(head + "Documents:" + separator, role="prefix")]
    for index, document in enumerate(documents):
        if index:
            segments.append(Segment(separator, cache=False))
        segments.append(Segment(document))
    segments.append(Segment(f"{separator}Question: {question}{tail}", cache=False))
    return segments
