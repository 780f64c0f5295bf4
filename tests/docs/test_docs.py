"""The docs stay true to the code: API reference current, settings documented, links valid."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
MARKDOWN = [
    ROOT / "README.md",
    *sorted(DOCS.glob("*.md")),
    *sorted((ROOT / "benchmarks").rglob("*.md")),
]

# [text](target) and ![alt](target), target without spaces; skips code spans and fenced blocks.
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _links(path: Path) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", path.read_text("utf-8")))
    return _LINK.findall(text)


def _anchors(path: Path) -> set[str]:
    """GitHub-style anchors of a Markdown file's headings."""
    text = _FENCE.sub("", path.read_text("utf-8"))
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.*)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


@pytest.mark.skipif(
    importlib.util.find_spec("langchain_core") is None, reason="needs the langchain extra"
)
def test_api_reference_is_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location("apidoc", ROOT / "scripts" / "apidoc.py")
    assert spec is not None and spec.loader is not None
    apidoc = importlib.util.module_from_spec(spec)
    sys.modules["apidoc"] = apidoc
    spec.loader.exec_module(apidoc)

    expected = apidoc.render()
    current = (DOCS / "api.md").read_text("utf-8")
    assert current == expected, (
        "docs/api.md is out of date with the code's signatures and docstrings: "
        "run `python scripts/apidoc.py` and commit the result"
    )


def test_every_strategy_and_setting_is_in_the_configuration_reference() -> None:
    from kvblend.blend.selectors import SELECTORS

    text = (DOCS / "configuration.md").read_text("utf-8")
    names = set(SELECTORS) | {name for cls in SELECTORS.values() for name in cls.settings}
    missing = sorted(
        name for name in names if f"`{name}`" not in text and f'`"{name}"`' not in text
    )
    assert not missing, f"not described in docs/configuration.md: {missing}"


def test_every_engine_option_is_in_the_configuration_reference() -> None:
    import inspect

    from kvblend import BlendEngine

    text = (DOCS / "configuration.md").read_text("utf-8")
    names = set(inspect.signature(BlendEngine.__init__).parameters) | set(
        inspect.signature(BlendEngine.from_pretrained).parameters
    )
    names -= {"self", "cls", "model", "tokenizer", "kwargs"}
    missing = sorted(name for name in names if f"`{name}`" not in text)
    assert not missing, f"BlendEngine options not described in docs/configuration.md: {missing}"


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_existing_files(path: Path) -> None:
    broken = []
    for target in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"broken links in {path.relative_to(ROOT)}: {broken}"


def test_docs_index_lists_every_page() -> None:
    linked = {target.partition("#")[0] for target in _links(DOCS / "index.md")}
    missing = [p.name for p in DOCS.glob("*.md") if p.name != "index.md" and p.name not in linked]
    assert not missing, f"docs/index.md does not link {missing}"


def test_readme_has_the_two_commands_and_ci_runs_the_test_one() -> None:
    """The README's set-up + demo and set-up + tests commands; `.ci/run` calls the latter."""
    readme = (ROOT / "README.md").read_text()
    demo = "bash scripts/install.sh && .venv/bin/kvblend demo"
    tests = "bash scripts/install.sh && .venv/bin/python -m pytest"
    assert demo in readme and tests in readme
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert ci[-1].strip() == tests


#: `pip install` of kvblend by its name (``kvblend[langchain]``, ``"kvblend"``): from a package
#: index kvblend is not on. A path (``-e ".[x]"``, ``dist/kvblend-....whl[x]``) is not matched.
_INDEX_INSTALL = re.compile(r"""pip install\b[^\n`]*?(?<![\w/.-])['"]?kvblend(?:\[|['"\s]|$)""")


def _doc_files() -> list[Path]:
    """Every Markdown and notebook file a reader opens: README, docs, benchmarks, cookbook."""
    return [*MARKDOWN, *sorted((ROOT / "cookbook").glob("*.ipynb"))]


def test_no_install_line_names_an_index_kvblend_is_not_on() -> None:
    """kvblend installs from a clone or the wheel built there, never ``pip install kvblend...``."""
    assert _INDEX_INSTALL.search('pip install "kvblend[langchain]"')
    assert _INDEX_INSTALL.search("pip install kvblend")
    assert not _INDEX_INSTALL.search('pip install -e ".[langchain]"')
    assert not _INDEX_INSTALL.search('pip install "dist/kvblend-0.1.0-py3-none-any.whl[redis]"')
    sources = [*_doc_files(), *sorted((ROOT / "src" / "kvblend").rglob("*.py"))]
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in sources
        for match in _INDEX_INSTALL.finditer(path.read_text("utf-8"))
    ]
    assert not found, f"install lines naming kvblend on a package index: {found}"
