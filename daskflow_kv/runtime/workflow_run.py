"""Which workflow run this thread is working for, told to the scheduler plugin.

The workflow executor runs each workflow inside ``workflow_run``. Compute tasks, states and
prefix lookups made meanwhile carry the run's name (``flow``), so under a KV budget the
plugin can admit waiting tasks in the order their runs began (a workflow's later levels go
before workflows that started after it; a run preempted to break a deadlock keeps its
place in line) and knows which runs keep which blocks pinned - whom to preempt to free
room. A context variable: concurrent workflows on threads of one client stay apart.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_RUN: ContextVar[str | None] = ContextVar("daskflow_kv_workflow_run", default=None)


def new_run_name(name: str = "run") -> str:
    """A workflow run's name: the workflow's, cut short, made unique."""
    return f"{name[:40]}-{uuid.uuid4().hex[:12]}"


@contextmanager
def workflow_run(name: str = "run") -> Iterator[str]:
    """What is submitted inside (this thread or task) belongs to one new workflow run."""
    token = _RUN.set(new_run_name(name))
    try:
        yield _RUN.get()
    finally:
        _RUN.reset(token)


def current_run() -> str | None:
    """The workflow run this thread is working for, if any."""
    return _RUN.get()
