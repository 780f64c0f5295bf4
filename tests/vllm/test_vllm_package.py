"""The vLLM connector's package as a vLLM engineer would maintain it: its shape, checked.

- Only `kvblend/vllm/compat.py` touches vLLM beyond its public API: every other module, those
  of `scheduling/` and `execution/` included, imports only vLLM's public modules (`PUBLIC`),
  reaches no private name (``obj._name``) it does not define itself, and probes no object's
  attributes by name (``getattr``/``hasattr``/``setattr``) except where it reads a transformers
  config (`PROBES`).
- No function is more complex than `MAX_COMPLEXITY` (radon's cyclomatic complexity), and the
  scheduler side's module stays under `SCHEDULER_LINES` lines.
- `compat.USES` holds on the installed vLLM, whose version is the one CI installs
  (``tests/vllm/test_vllm_compat.py`` checks it in vLLM's environment).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "src" / "kvblend" / "vllm"
#: vLLM's public APIs the connector is written against.
PUBLIC = {
    "vllm.distributed",  # tensor_model_parallel_all_reduce
    "vllm.distributed.kv_transfer.kv_connector.v1.base",  # the KV connector API
    "vllm.distributed.kv_transfer.kv_connector.v1.metrics",  # its stats and Prometheus classes
    "vllm.v1.sample.logits_processor",  # the logits-processor API (options.py)
}
#: Where a module (its path in the package) may read attributes by name: a transformers
#: config's optional fields.
PROBES = {("documents.py", "config_shape")}
MAX_COMPLEXITY = 12
SCHEDULER_LINES = 300


def _sources() -> list[Path]:
    """Every module of the package, its subpackages' included."""
    return sorted(PACKAGE.rglob("*.py"))


def _modules() -> list[Path]:
    return [path for path in _sources() if path != PACKAGE / "compat.py"]


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _vllm_imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "vllm"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            found.add(str(node.module))
    return found


def _own_names(tree: ast.AST) -> set[str]:
    """Names a module defines: functions, classes, attributes it assigns, fields it declares."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _probes(tree: ast.AST) -> set[str]:
    """The functions that call getattr, hasattr or setattr."""
    found = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef):
            continue
        for node in ast.walk(function):
            called = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if called and node.func.id in {"getattr", "hasattr", "setattr"}:  # type: ignore[attr-defined]
                found.add(function.name)
    return found


def test_only_compat_touches_vllm_beyond_its_public_api() -> None:
    assert {"scheduling/scheduler.py", "execution/worker.py"} <= {_name(p) for p in _modules()}
    for path in _modules():
        tree = ast.parse(path.read_text("utf-8"))
        assert _vllm_imports(tree) <= PUBLIC, (_name(path), _vllm_imports(tree) - PUBLIC)
        own = _own_names(tree)
        private = {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and node.attr not in own
        }
        assert not private, (_name(path), private)
        probes = {(_name(path), name) for name in _probes(tree)}
        assert probes <= PROBES, probes - PROBES


def test_the_checks_above_can_fail() -> None:
    """A module reaching a private name of vLLM's, or probing its objects, is caught."""
    tree = ast.parse(
        "from vllm.v1.request import Request\n"
        "def f(request):\n    request._block_hasher = None\n    return request._block_hasher\n"
        "def g(request):\n    return getattr(request, 'prefill_stats', None)\n"
    )
    assert _vllm_imports(tree) - PUBLIC == {"vllm.v1.request"}
    assert _probes(tree) == {"g"}
    reading = ast.parse("def f(request):\n    return request._block_hasher\n")
    assert "_block_hasher" not in _own_names(reading)


def test_no_function_is_too_complex_and_the_scheduler_stays_short() -> None:
    from radon.complexity import add_inner_blocks, cc_visit

    too_complex = {
        f"{_name(path)}:{block.name}": block.complexity
        for path in _sources()
        for block in add_inner_blocks(cc_visit(path.read_text("utf-8")))
        if block.letter != "C" and block.complexity > MAX_COMPLEXITY  # functions and methods
    }
    assert not too_complex, too_complex
    lines = len((PACKAGE / "scheduling" / "scheduler.py").read_text("utf-8").splitlines())
    assert lines < SCHEDULER_LINES, lines


def test_a_use_the_installed_library_changed_is_named() -> None:
    """`compat.Use.check` says which name is gone (here on the standard library's json)."""
    from kvblend.vllm.compat import Use

    assert Use("fine", "json", "JSONDecoder", "sets", ("parse_float", "decode")).check() is None
    changed = Use("a field", "json", "JSONDecoder", "sets", ("parse_float", "no_such_field"))
    assert changed.check() == "a field: JSONDecoder has no no_such_field"
    renamed = Use("a parameter", "json", "dumps", "params", ("obj", "no_such_parameter"))
    assert renamed.check() == "a parameter: dumps has no no_such_parameter"
    gone = Use("a class", "json", "NoSuchClass", "sets", ("x",)).check()
    assert gone is not None and "json.NoSuchClass is gone" in gone
