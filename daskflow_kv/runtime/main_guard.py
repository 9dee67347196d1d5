"""Refuse to start a local cluster from a script's unguarded top level, in one line.

Dask's local worker processes start with multiprocessing's ``spawn`` method: each child
re-runs the main script as ``__mp_main__``. A script that starts a cluster outside
``if __name__ == "__main__":`` starts one again in every child, each child dies, and the
user gets ``RuntimeError: Nanny failed to start`` under a wall of tracebacks that never
mentions the guard. ``check_main_guard`` runs before the cluster starts and says what to add:

* in the parent, it finds the main script's top-level statement that led here and refuses
  when no ``if __name__ == "__main__":`` encloses it (the children would run it again);
* in a child, it refuses when called while the main module is being re-imported.

It never refuses what it cannot read (a notebook, ``python -c``, a ``__main__.py`` of a
package, source it cannot parse): those are not re-run by ``spawn`` or cannot be judged.
"""

from __future__ import annotations

import ast
import multiprocessing
import inspect
import os
import sys

from ..errors import DaskflowKVError

GUARD = 'if __name__ == "__main__":'


class MainGuardError(DaskflowKVError, RuntimeError):
    """A local cluster was started where its spawned worker processes would start it again."""


def check_main_guard(what: str = "a local Dask cluster", start_method: str | None = None) -> None:
    """Raise ``MainGuardError`` when starting ``what`` here would re-run in every worker process.

    ``start_method``: the children's multiprocessing start method (default: Dask's
    ``distributed.worker.multiprocessing-method``); ``fork`` re-imports nothing.
    """
    if start_method is None:
        import dask

        start_method = dask.config.get("distributed.worker.multiprocessing-method", "spawn")
    if start_method == "fork":
        return
    child = _reimport_frame()
    if child is not None:
        raise MainGuardError(
            f"{what} was started while a worker process re-imported the main script "
            f"({child.f_code.co_filename}, line {child.f_lineno}): put the code that starts it under `{GUARD}`")
    script = _main_script_rerun_by_children()
    if script is None:
        return
    frame = _top_level_frame(sys.modules["__main__"])
    if frame is None or not _same_file(frame.f_code.co_filename, script):
        return  # not the script's own code (``python -i``'s prompt runs in __main__ too)
    if _guarded(script, frame.f_lineno) is not False:
        return
    name = os.path.basename(script)
    raise MainGuardError(
        f"{what} called at the top level of {name} (line {frame.f_lineno}): Dask's worker processes re-run "
        f"{name} when they start ({start_method}) and would each start it again; put that code under `{GUARD}`")


def _reimport_frame():
    """The re-imported main module's top-level frame on this stack, in a spawned child; else None."""
    if multiprocessing.current_process().name == "MainProcess":
        return None
    frame = inspect.currentframe().f_back
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__mp_main__":
            return frame
        frame = frame.f_back
    return None


def _main_script_rerun_by_children() -> str | None:
    """The file ``spawn`` re-runs in each child (as ``multiprocessing.spawn`` decides), or None."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not path:
        return None  # a notebook, a REPL, ``python -c``: nothing is re-run
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return None  # ``python -m package``: its __main__.py is not re-run
    if os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    return path


def _top_level_frame(main):
    """The main module's ``<module>`` frame on this stack (where the call began), or None."""
    frame = inspect.currentframe().f_back
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is main.__dict__:
            return frame
        frame = frame.f_back
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # "<stdin>", "<string>": no file
        return False


def _guarded(path: str, line: int) -> bool | None:
    """Whether ``line`` of ``path`` lies in the body of an ``if __name__ == "__main__":``
    (None: the source cannot be read or the line is in no statement)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    body, found = tree.body, False
    while True:
        node = next((n for n in body if n.lineno <= line <= (n.end_lineno or n.lineno)), None)
        if node is None:
            return False if found else None
        found = True
        if isinstance(node, ast.If) and _is_main_test(node.test) and _within(node.body, line):
            return True
        inner = [getattr(node, f, []) for f in ("body", "orelse", "finalbody", "handlers")]
        body = [n for block in inner for n in block if isinstance(n, ast.stmt | ast.excepthandler)]
        if not body:
            return False


def _within(body: list[ast.stmt], line: int) -> bool:
    return bool(body) and body[0].lineno <= line <= (body[-1].end_lineno or body[-1].lineno)


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either side)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))
