"""Generate docs/api.md, the API reference, from the public names' signatures and docstrings.

Run ``python scripts/apidoc.py`` from the repository root to rewrite ``docs/api.md``, or
``python scripts/apidoc.py --check`` to exit with status 1 when the file is out of date
(``tests/docs/test_docs.py`` does the same). The public names are each module's ``__all__``; classes
list their public methods and properties defined in kvblend, and pydantic models (the framework
adapters) list their fields with the docstring written under each field.

Documentation tooling, not part of the package: it lives here so that the wheel does not ship it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Modules documented, in order, with a one-line summary. Optional integrations are documented
#: when their module exists in the source tree (their extras are part of ``kvblend[all]``).
MODULES: tuple[tuple[str, str], ...] = (
    ("kvblend", "The engine: `BlendEngine`, `BlendConfig`, `Segment` and their results."),
    ("kvblend.store", "KV stores: memory, disk, tiered and Redis (see [store.md](store.md))."),
    ("kvblend.matching", "Finding known documents inside a finished prompt."),
    ("kvblend.integrations", "Public names of the adapters' framework-neutral shared layer."),
    ("kvblend.langchain", "LangChain adapters (see [langchain.md](langchain.md))."),
    ("kvblend.llamaindex", "LlamaIndex adapters."),
)

HEADER = """\
# API reference

Generated from the docstrings by `python scripts/apidoc.py`; do not edit by hand.
`tests/docs/test_docs.py` fails when this file and the code disagree: run the command again after
changing a public signature or docstring.

Guides and background: [index.md](index.md).
"""


# Methods that pydantic writes into a model class; not part of kvblend's API.
_GENERATED = frozenset({"model_post_init"})


def module_exists(name: str) -> bool:
    """Whether module ``name`` is part of the installed kvblend source tree."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def render() -> str:
    """Return the full text of docs/api.md for the code as it is now."""
    parts = [HEADER]
    present = [(name, summary) for name, summary in MODULES if module_exists(name)]
    parts.append("## Modules\n")
    parts.extend(f"- [`{name}`](#{_slug(name)}): {summary}" for name, summary in present)
    parts.append("")
    for name, summary in present:
        parts.extend(_module(name, summary))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(parts)).rstrip() + "\n"


def _slug(title: str) -> str:
    """Return the anchor GitHub gives a heading: lower case, no punctuation, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _link(text: str, heading: str) -> str:
    return f"[`{text}`](#{_slug(heading)})"


def _heading(module: str, public: str, obj: Any) -> str:
    """Return the heading text of a public name (its anchor is `_slug` of it)."""
    if inspect.isclass(obj):
        kind = "exception" if issubclass(obj, BaseException) else "class"
        return f"{kind} `{module}.{public}`"
    if inspect.isfunction(obj):
        return f"`{module}.{public}`"
    return f"`{module}.{public}`"


def _module(name: str, summary: str) -> Iterator[str]:
    module = importlib.import_module(name)
    yield f"## {name}\n"
    yield f"{summary}\n"
    doc = _doc(module)
    if doc:
        yield doc + "\n"
    publics = [public for public in getattr(module, "__all__", ()) if not public.startswith("__")]
    if publics:
        links = (
            _link(public, _heading(name, public, getattr(module, public))) for public in publics
        )
        yield "Contents: " + ", ".join(links) + ".\n"
    for public in publics:
        obj = getattr(module, public)
        if inspect.isclass(obj):
            yield from _class(name, public, obj)
        elif inspect.isfunction(obj):
            yield from _function(f"{name}.{public}", obj, level=3)
        else:
            yield f"### {_heading(name, public, obj)}\n"
            yield f"```python\n{public} = {obj!r}\n```\n"


def _class(module: str, name: str, cls: type) -> Iterator[str]:
    kind = "exception" if issubclass(cls, BaseException) else "class"
    fields = _pydantic_fields(cls)
    yield f"### {kind} `{module}.{name}`\n"
    if fields is None:
        yield f"```python\n{name}{_signature(cls)}\n```\n"
    bases = [b for b in cls.__bases__ if b is not object]
    if bases:
        yield "Bases: " + ", ".join(f"`{_qualname(b)}`" for b in bases) + "\n"
    doc = _doc(cls)
    if doc:
        yield doc + "\n"
    if fields:
        yield "| field | type | default | description |"
        yield "|-------|------|---------|-------------|"
        for field_name, annotation, default, description in fields:
            cells = (f"`{field_name}`", f"`{annotation}`", f"`{default}`", description)
            yield "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
        yield ""
    members = _members(cls)
    if members:
        yield (
            "Members: "
            + ", ".join(
                _link(member_name, _member_heading(name, member_name, member))
                for member_name, member in members
            )
            + ".\n"
        )
    for member_name, member in members:
        if isinstance(member, property):
            yield f"#### {_member_heading(name, member_name, member)}\n"
            doc = _doc(member.fget)
            if doc:
                yield doc + "\n"
        else:
            yield from _function(f"{name}.{member_name}", member, level=4)


def _member_heading(cls_name: str, member_name: str, member: Any) -> str:
    """Return the heading text of a class's method or property."""
    if isinstance(member, property):
        return f"property `{cls_name}.{member_name}`"
    prefix = "classmethod " if isinstance(member, classmethod) else ""
    return f"{prefix}`{cls_name}.{member_name}`"


def _function(qualified: str, func: Any, level: int) -> Iterator[str]:
    prefix = "classmethod " if isinstance(func, classmethod) else ""
    target = _undecorated(func.__func__ if isinstance(func, (classmethod, staticmethod)) else func)
    keyword = "async def" if inspect.iscoroutinefunction(target) else "def"
    signature = _signature(target, drop_self=not isinstance(func, staticmethod))
    name = qualified.rsplit(".", 1)[-1]
    yield f"{'#' * level} {prefix}`{qualified}`\n"
    yield f"```python\n{keyword} {name}{signature}\n```\n"
    doc = _doc(target)
    if doc:
        yield doc + "\n"


def _undecorated(func: Any) -> Any:
    """Return the function a framework decorator wrapped (found in the wrapper's closure)."""
    for cell in getattr(func, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if (
            inspect.isfunction(inner)
            and inner.__name__ == func.__name__
            and inner.__code__ is not func.__code__
        ):
            return _undecorated(inner)
    return func


def _members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties ``cls`` defines itself or inherits from kvblend classes."""
    seen: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("kvblend"):
            continue
        for member_name, member in vars(klass).items():
            if member_name.startswith("_") or member_name in _GENERATED:
                continue
            if isinstance(member, (property, classmethod, staticmethod)) or inspect.isfunction(
                member
            ):
                seen[member_name] = member
    for klass in cls.__mro__:  # a member redefined outside kvblend is not ours any more
        if not klass.__module__.startswith("kvblend"):
            for member_name in list(seen):
                if member_name in vars(klass) and not _defined_in_kvblend(cls, member_name):
                    del seen[member_name]
    if dataclasses.is_dataclass(cls):
        for field in dataclasses.fields(cls):
            seen.pop(field.name, None)
    return sorted(seen.items())


def _defined_in_kvblend(cls: type, member_name: str) -> bool:
    for klass in cls.__mro__:
        if member_name in vars(klass):
            return klass.__module__.startswith("kvblend")
    return False


class _Raw(str):
    """An annotation written as source text, shown without quotes."""

    def __repr__(self) -> str:
        return str(self)


def _signature(obj: Any, drop_self: bool = True) -> str:
    try:
        signature = inspect.signature(obj, follow_wrapped=False)
    except (TypeError, ValueError):
        return "(...)"
    parameters = []
    for parameter in signature.parameters.values():
        annotation = parameter.annotation
        if isinstance(annotation, str):
            parameter = parameter.replace(annotation=_Raw(annotation))
        parameters.append(parameter)
    if drop_self and parameters and parameters[0].name in ("self", "cls", "_self"):
        parameters = parameters[1:]
    returns = signature.return_annotation
    if inspect.isclass(obj):
        returns = inspect.Signature.empty
    elif isinstance(returns, str):
        returns = _Raw(returns)
    return str(signature.replace(parameters=parameters, return_annotation=returns))


def _qualname(cls: type) -> str:
    """Return the public dotted name of ``cls`` (a documented module exporting it, if any)."""
    if cls.__module__.startswith("kvblend"):
        for module_name, _ in MODULES:
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, cls.__name__, None) is cls:
                return f"{module_name}.{cls.__qualname__}"
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def _doc(obj: Any) -> str:
    doc = inspect.getdoc(obj) if obj is not None else None
    if not doc:
        return ""
    if inspect.isclass(obj) and obj.__doc__ is None:
        return ""  # inherited from a base outside the class itself
    return _to_markdown(doc)


def _to_markdown(doc: str) -> str:
    """Turn the reStructuredText bits kvblend docstrings use into Markdown."""
    lines = doc.splitlines()
    out: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.strip().startswith(".. code-block::"):
            language = line.split("::", 1)[1].strip() or "python"
            indent = len(line) - len(line.lstrip())
            block: list[str] = []
            index += 1
            while index < len(lines) and (
                not lines[index].strip() or len(lines[index]) - len(lines[index].lstrip()) > indent
            ):
                block.append(lines[index])
                index += 1
            out.append(f"```{language}")
            out.extend(textwrap.dedent("\n".join(block)).strip("\n").splitlines())
            out.append("```")
            continue
        section = _SECTION.fullmatch(line.strip())
        if section and index + 1 < len(lines) and lines[index + 1].startswith(" "):
            index = _section(lines, index + 1, section.group(1), out)
            continue
        out.append(line.replace("``", "`"))
        index += 1
    return "\n".join(out).strip()


_SECTION = re.compile(r"(Args|Arguments|Attributes|Returns|Raises|Yields):")
_ITEM = re.compile(r"(\*{0,2}[A-Za-z_][\w.]*)(?: \(([^)]*)\))?: (.*)")


def _section(lines: list[str], index: int, title: str, out: list[str]) -> int:
    """Render a Google-style docstring section as a bold title and a bullet list."""
    out.extend(["", f"**{title}:**", ""])
    items: list[str] = []
    indent = len(lines[index]) - len(lines[index].lstrip())
    while index < len(lines) and (not lines[index].strip() or lines[index].startswith(" ")):
        line = lines[index]
        text = line.strip().replace("``", "`")
        index += 1
        if not text:
            continue
        match = _ITEM.fullmatch(text)
        if len(line) - len(line.lstrip()) == indent and match and title != "Returns":
            name, kind, rest = match.groups()
            items.append(f"- `{name}`" + (f" ({kind})" if kind else "") + f": {rest}")
        elif items:
            items[-1] += " " + text
        else:
            items.append(text)
    out.extend(items)
    out.append("")
    return index


def _pydantic_fields(cls: type) -> list[tuple[str, str, str, str]] | None:
    """Fields of a pydantic model declared in kvblend classes, or None for other classes."""
    model_fields = getattr(cls, "model_fields", None)
    if not isinstance(model_fields, dict):
        return None
    documented: dict[str, tuple[str, str]] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__.startswith("kvblend"):
            documented.update(_attribute_docs(klass))
    rows = []
    for field_name, info in model_fields.items():
        if field_name not in documented:
            continue
        annotation, description = documented[field_name]
        description = description or info.description or ""
        default = "required" if info.is_required() else repr(info.get_default())
        rows.append((field_name, annotation, default, " ".join(description.split())))
    return rows


def _attribute_docs(cls: type) -> dict[str, tuple[str, str]]:
    """``{field: (annotation, docstring)}`` for the annotated attributes in ``cls``'s source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, tuple[str, str]] = {}
    statements = body.body
    for position, statement in enumerate(statements):
        if not isinstance(statement, ast.AnnAssign) or not isinstance(statement.target, ast.Name):
            continue
        name = statement.target.id
        if name.startswith("_"):
            continue
        following = statements[position + 1] if position + 1 < len(statements) else None
        description = ""
        if (
            isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            description = inspect.cleandoc(following.value.value).replace("``", "`")
        docs[name] = (ast.unparse(statement.annotation), description)
    return docs


def main(argv: list[str] | None = None) -> int:
    """Write docs/api.md (or, with ``--check``, report whether it is up to date)."""
    parser = argparse.ArgumentParser(prog="scripts/apidoc.py", description=__doc__)
    parser.add_argument("--output", default="docs/api.md", help="file to write or check")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is out of date")
    args = parser.parse_args(argv)
    text = render()
    path = Path(args.output)
    if args.check:
        if not path.is_file() or path.read_text("utf-8") != text:
            print(f"{path} is out of date: run python scripts/apidoc.py", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.write_text(text, "utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
