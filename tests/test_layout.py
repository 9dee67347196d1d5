"""The package's layers, read from its imports: no circles, and no layer imports one above it.

Every import counts, module-level or inside a function: a lazy import is still a
dependency. Only ``if TYPE_CHECKING:`` blocks are skipped (they never run).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import daskflow_kv

PKG = Path(daskflow_kv.__file__).resolve().parent
TOP = "daskflow_kv"

# What each part of the package may import from the package (besides itself).
ALLOWED = {
    "errors": set(),
    "config": {"errors"},
    "validation": {"errors", "config"},  # level 0: input checks every layer may use
    "dask_internals": set(),  # level 0: every non-public Dask use, one place
    "state": {"errors", "config", "validation"},
    "policy": {"errors", "config", "validation"},
    "store": {"state", "errors", "config", "validation"},  # the persistent tier: tensors and files, no Dask
    "model": {"state", "errors", "config", "validation"},
    "engine": {"model", "state", "errors", "config", "validation"},
    "plugins": {"state", "policy", "errors", "config", "validation", "dask_internals"},
    "runtime": {"plugins", "model", "store", "state", "policy", "errors", "config", "validation", "dask_internals"},
    "flow": {"runtime", "model", "state", "policy", "errors", "config", "validation"},
    "workflows": {"flow", "errors", "validation"},
    "bench": {"flow", "runtime", "engine", "plugins", "model", "store", "state", "policy", "errors", "config",
              "workflows", "validation", "dask_internals"},
    "cli": {"bench", "workflows", "flow", "runtime", "engine", "plugins", "model", "store", "state", "policy", "errors",
            "config", "validation", "dask_internals"},
    "__init__": set(),  # exports by name, imported lazily
}
# Third-party packages a part must not import (the scheduler plugin and the policy stay light).
FORBIDDEN_THIRD_PARTY = {
    "validation": {"torch", "transformers", "distributed", "numpy"},
    "policy": {"torch", "transformers", "dask", "distributed", "numpy"},
    "state": {"transformers", "dask", "distributed"},
    "model": {"dask", "distributed"},
    "plugins": {"torch", "transformers"},
    "store": {"transformers", "distributed"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(path: Path) -> list[list[str]]:
    """What ``path`` imports: one list of candidate names per imported thing.

    ``from x import y`` gives ``[x.y, x]``: y if it is a module, else x (y is a name in x).
    """
    mod = _module_name(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out: list[list[str]] = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                out.extend([a.name] for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    src = ".".join(base + ([child.module] if child.module else []))
                else:
                    src = child.module or ""
                out.extend([f"{src}.{a.name}", src] for a in child.names)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PKG.rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        deps = set()
        for candidates in _imports(path):
            # the first candidate that is one of our modules, or the longest module prefix of the last
            hit = next((c for c in candidates if c in files), None)
            if hit is None:
                parts = candidates[-1].split(".")
                while parts and ".".join(parts) not in files:
                    parts.pop()
                hit = ".".join(parts) if parts else None
            if hit and hit != mod:
                deps.add(hit)
        graph[mod] = deps
    return graph


def _part(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_layers_import_only_downward():
    bad = []
    for mod, deps in _graph().items():
        part = _part(mod)
        assert part in ALLOWED, f"{mod}: new top-level part {part!r}; give it a place in ALLOWED"
        for dep in deps:
            other = _part(dep)
            if other != part and other not in ALLOWED[part]:
                bad.append(f"{mod} -> {dep}")
    assert bad == []


def test_light_parts_avoid_heavy_packages():
    bad = []
    for path in PKG.rglob("*.py"):
        mod = _module_name(path)
        banned = FORBIDDEN_THIRD_PARTY.get(_part(mod), set())
        for candidates in _imports(path):
            if candidates[-1].split(".")[0] in banned:
                bad.append(f"{mod} imports {candidates[-1]}")
    assert bad == []


def test_the_scheduler_plugin_loads_without_torch():
    """What a scheduler preloads must not drag in torch or transformers (seconds, and GBs)."""
    code = (
        "import sys, daskflow_kv.plugins.kv_scheduler, daskflow_kv.plugins.kv_dashboard;"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_detector_finds_a_circle():
    """The checks above can fail: a planted circle is found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_public_api_imports():
    from daskflow_kv import Engine, KVRuntime, Workflow  # noqa: F401
    from daskflow_kv.plugins.kv_scheduler import KVSchedulerPlugin  # noqa: F401
    from daskflow_kv.runtime import KVRuntime as RT, embedded_runtime  # noqa: F401
    from daskflow_kv.workflows import WORKFLOWS

    assert RT is KVRuntime
    assert set(WORKFLOWS) == {"tot", "debate", "rag", "planner"}
