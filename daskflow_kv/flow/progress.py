"""A workflow run's progress, shown the way Dask tools show it: a bar where someone watches.

``tqdm.auto`` draws a widget in a notebook and a text bar on a terminal. Nothing is drawn
when nobody watches (stderr is not a terminal and this is no notebook: a log file, a
pipe, a batch job) unless asked: ``progress=True``, or the ``daskflow-kv.verbose`` setting
(the CLI's ``--verbose``). Without tqdm a line per level goes to stderr instead.

The bar counts agents: the executor reports each level as it starts (its ``progress``
callback), so the agents of the level before it are done.
"""

from __future__ import annotations

import sys

from .. import config


def in_notebook() -> bool:
    """A Jupyter kernel (never imports IPython itself)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def wanted(progress: bool | None) -> bool:
    """``progress`` when given; else the ``daskflow-kv.verbose`` setting, a notebook, or a terminal."""
    if progress is not None:
        return bool(progress)
    if config.get("verbose"):
        return True
    try:
        return in_notebook() or sys.stderr.isatty()
    except (AttributeError, ValueError):  # stderr replaced or closed
        return False


class LevelProgress:
    """The executor's per-level callback, drawing one bar over every agent of the run."""

    __slots__ = ("_bar", "_done", "_total", "_pending")

    def __init__(self, agents: int, modes: int = 1):
        self._total = agents * modes  # agent runs to come (each agent once per mode)
        self._done = 0  # agent runs finished
        self._pending = 0  # agents of the level now running
        try:
            from tqdm.auto import tqdm
        except ImportError:
            self._bar = None  # a line per level on stderr instead
        else:
            self._bar = tqdm(total=self._total, desc="workflow", unit="agent", leave=True, file=sys.stderr)

    def __call__(self, mode: str, level: int, levels: int, names) -> None:
        self._advance(self._pending)
        self._pending = len(names)
        what = f"[{mode}] level {level + 1}/{levels}"
        if self._bar is not None:
            self._bar.set_description(what, refresh=True)
        else:
            print(f"{what}: {', '.join(names)}", file=sys.stderr, flush=True)

    def _advance(self, n: int) -> None:
        self._done += n
        if self._bar is not None and n:
            self._bar.update(n)

    def close(self, done: bool = True) -> None:
        """The run ended: count its last level when it finished (``done``), then close the bar."""
        if done:
            self._advance(self._pending)
        self._pending = 0
        if self._bar is not None:
            self._bar.close()


def for_run(agents: int, mode: str, progress: bool | None) -> LevelProgress | None:
    """A bar for a run of ``agents`` agents in ``mode`` (state | text | both), or None when unwanted."""
    return LevelProgress(agents, 2 if mode == "both" else 1) if wanted(progress) else None
