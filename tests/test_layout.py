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
    "plain_checks": {"errors"},  # level 0: the input checks that need nothing but Python
    "validation": {"errors", "config", "plain_checks"},  # level 0: input checks every layer may use
    "dask_internals": set(),  # level 0: every non-public Dask use, one place
    "stats": set(),  # level 0: order statistics (the bench, the simulator, the KV page's plots)
    "state": {"keys", "errors", "config", "validation"},
    "policy": {"errors", "plain_checks"},  # no config, no validation: both import Dask
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
    "plain_checks": {"torch", "transformers", "dask", "distributed", "numpy"},
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


def _source_of(node: ast.ImportFrom, package: str) -> str:
    """The absolute module ``from <module> import ...`` names, inside ``package``."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _package_of(path: Path) -> str:
    mod = _module_name(path)
    return mod if path.name == "__init__.py" else mod.rpartition(".")[0]


def _imports(path: Path) -> list[list[str]]:
    """What ``path`` imports: one list of candidate names per imported thing.

    ``from x import y`` gives ``[x.y, x]``: y if it is a module, else x (y is a name in x).
    """
    package = _package_of(path)
    out: list[list[str]] = []

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                out.extend([a.name] for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                src = _source_of(child, package)
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


# Parts that reach none of their forbidden packages through the package either: nothing they
# import, however far down, imports one (the package's __init__ aside, which registers the
# settings). policy/ is pure policy on plain data: no Dask, not even by way of a helper.
STRICT = ("policy", "plain_checks", "keys", "stats")


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph.get(todo.pop(), ()):
            if dep not in seen and dep != TOP:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_strict_parts_reach_no_heavy_package_through_the_package():
    files = {_module_name(p): p for p in _sources()}
    third_party = {mod: {c[-1].split(".")[0] for c in _imports(path)} for mod, path in files.items()}
    graph, bad = _graph(), []
    for mod in files:
        if _part(mod) in STRICT:
            for dep in sorted(_reached(graph, mod)):
                heavy = third_party[dep] & FORBIDDEN_THIRD_PARTY[_part(mod)]
                bad += [f"{mod} -> {dep} imports {h}" for h in sorted(heavy)]
    assert bad == []


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_uses(source: str, package: str, modules: set[str]) -> list[str]:
    """Another module's private names that ``source`` (a module in ``package``) uses:
    ``from x import _name``, and ``m._name`` on a module ``m`` of ``modules`` it imported."""
    tree = ast.parse(source)
    out, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            src = _source_of(node, package)
            if src.split(".")[0] != TOP:
                continue
            for a in node.names:
                if _is_private(a.name):
                    out.append(f"from {src} import {a.name}")
                elif f"{src}.{a.name}" in modules:
                    bound[a.asname or a.name] = f"{src}.{a.name}"
        elif isinstance(node, ast.Import):
            bound.update({a.asname: a.name for a in node.names if a.asname and a.name in modules})
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _is_private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in bound):
            out.append(f"{bound[node.value.id]}.{node.attr}")
    return sorted(set(out))


# Private names still imported from files being rewritten elsewhere (issue 56, model/): each
# goes when its file is next changed.
def test_no_module_uses_another_modules_private_names():
    """A name another module needs is public: ``_name`` is free to change with its own module."""
    files = {_module_name(p): p for p in _sources()}
    found = {f"{mod}: {use}" for mod, path in files.items()
             for use in _private_uses(path.read_text(), _package_of(path), set(files))}
    # the benchmark and helper scripts use the package as any other program would
    scripts = sorted((ROOT / "benchmarks").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py"))
    found |= {f"{path.relative_to(ROOT)}: {use}" for path in scripts
              for use in _private_uses(path.read_text(), "", set(files))}
    assert sorted(found) == []


def test_the_private_name_check_finds_both_forms():
    source = "from .chaos import _run, agent_tokens\nfrom . import report_md as R\nR._table([], [])\n"
    modules = {f"{TOP}.bench.chaos", f"{TOP}.bench.report_md"}
    assert set(_private_uses(source, f"{TOP}.bench", modules)) == {
        f"from {TOP}.bench.chaos import _run", f"{TOP}.bench.report_md._table"}


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
