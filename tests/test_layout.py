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

ROOT = Path(__file__).resolve().parent.parent
TOP = "daskflow_kv"
# The package's source folders: the design card keeps plugins/ and workflows/ at the top of
# the repository; pyproject.toml's package-dir installs them under daskflow_kv.
SOURCES = {TOP: ROOT / "daskflow_kv", f"{TOP}.plugins": ROOT / "plugins", f"{TOP}.workflows": ROOT / "workflows"}
PKG = SOURCES[TOP]

# What each part of the package may import from the package (besides itself).
ALLOWED = {
    "errors": set(),
    "keys": set(),  # level 0: every Dask key kind and topic name
    "config": {"errors"},
    "validation": {"errors", "config"},  # level 0: input checks every layer may use
    "dask_internals": set(),  # level 0: every non-public Dask use, one place
    "stats": set(),  # level 0: order statistics (the bench, the simulator, the KV page's plots)
    "state": {"keys", "errors", "config", "validation"},
    "policy": {"errors", "config", "validation"},
    "transport": {"errors", "config", "keys"},  # tensors on the wire: serializers, sizeof
    "store": {"state", "transport", "keys", "errors", "config", "validation"},  # the persistent tier
    "model": {"state", "policy", "keys", "errors", "config", "validation"},
    "engine": {"model", "state", "policy", "keys", "errors", "config", "validation"},
    # scheduler side torch-free; worker plugins import store/transport in ``setup``, on the worker
    "plugins": {"state", "policy", "store", "transport", "keys", "errors", "config", "validation", "dask_internals",
                "stats"},
    "runtime": {"plugins", "model", "store", "transport", "state", "policy", "keys", "errors", "config", "validation",
                "dask_internals"},
    "flow": {"runtime", "model", "state", "policy", "keys", "errors", "config", "validation", "dask_internals"},
    "workflows": {"flow", "errors", "validation"},
    "bench": {"flow", "runtime", "engine", "plugins", "model", "store", "transport", "state", "policy", "keys",
              "errors", "config", "workflows", "validation", "dask_internals", "stats"},
    "sim": {"bench", "policy", "errors", "config", "validation", "stats"},  # the real policies on modeled workers
    "cli": {"sim", "bench", "workflows", "flow", "runtime", "engine", "plugins", "model", "store", "transport", "state",
            "policy", "keys", "errors", "config", "validation", "dask_internals"},
    "__init__": {"config"},  # registers the settings on import; exports by name, imported lazily
}
# Third-party packages a part must not import (the scheduler plugin and the policy stay light).
FORBIDDEN_THIRD_PARTY = {
    "keys": {"torch", "transformers", "dask", "distributed", "numpy"},
    "transport": {"transformers"},
    "validation": {"torch", "transformers", "distributed", "numpy"},
    "stats": {"torch", "transformers", "dask", "distributed", "numpy"},
    "policy": {"torch", "transformers", "dask", "distributed", "numpy"},
    "state": {"transformers", "dask", "distributed"},
    "model": {"dask", "distributed"},
    "plugins": {"torch", "transformers"},
    "store": {"transformers", "distributed"},
}


# Modules that run inside Dask workers and say so in their docstring: the rule above is for
# the rest of their part (the store's files and codecs work without Dask).
WORKER_SIDE = {"daskflow_kv.store.worker_io": {"distributed"}}


def _module_name(path: Path) -> str:
    for package, folder in sorted(SOURCES.items(), key=lambda kv: -len(kv[0])):
        if path.is_relative_to(folder):
            parts = package.split(".") + list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join(parts)
    raise ValueError(f"{path} is in none of the package's source folders")


def _sources() -> list[Path]:
    """Every module of the package, from its real folders (plugins/ and workflows/ too)."""
    out = [p for p in PKG.rglob("*.py")]
    for package, folder in SOURCES.items():
        if package != TOP:
            out += folder.rglob("*.py")
    return sorted(out)


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
    files = {_module_name(p): p for p in _sources()}
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
    for path in _sources():
        mod = _module_name(path)
        banned = FORBIDDEN_THIRD_PARTY.get(_part(mod), set()) - WORKER_SIDE.get(mod, set())
        for candidates in _imports(path):
            if candidates[-1].split(".")[0] in banned:
                bad.append(f"{mod} imports {candidates[-1]}")
    assert bad == []


def test_the_scheduler_plugin_loads_without_torch():
    """What a scheduler preloads must not drag in torch or transformers (seconds, and GBs)."""
    code = (
        "import sys, daskflow_kv.plugins.kv_scheduler, daskflow_kv.plugins.dashboard;"
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


def test_the_top_level_is_the_design_cards():
    """engine, plugins, workflows, tests, benchmarks at the top; the installed package maps
    daskflow_kv.plugins and daskflow_kv.workflows onto the top-level folders."""
    import daskflow_kv.plugins
    import daskflow_kv.workflows

    for entry in ("pyproject.toml", "README.md", "daskflow_kv", "plugins", "workflows", "tests", "benchmarks"):
        assert (ROOT / entry).exists(), entry
    assert Path(daskflow_kv.plugins.__file__).resolve().parent == SOURCES[f"{TOP}.plugins"]
    assert Path(daskflow_kv.workflows.__file__).resolve().parent == SOURCES[f"{TOP}.workflows"]
    assert not (PKG / "plugins").exists() and not (PKG / "workflows").exists()
    assert any(m.startswith(f"{TOP}.plugins.") for m in _graph()), "the layering rules must cover the plugins"
