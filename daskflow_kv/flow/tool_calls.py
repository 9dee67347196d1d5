"""Tool calls as Dask tasks: submitted once what they read exists, timed on the worker.

A ``Tool`` (``spec.Tool``: a user's function, a search, a memory read or write) runs as one
task on whatever worker has the resources it asks for - not necessarily a model worker -
with Dask's retries. Its output is text; ``ToolCalls`` hands it back with the seconds the
function ran, which feed ``HISTORY``: the measured durations the KV-during-the-wait policy
(``policy.kv_wait``) expects the next call of the same tool to take.

An argument that must live on the cluster rather than travel with every call (a corpus)
defines ``for_cluster(calls)``: it is replaced by what that returns (a future scattered
once per client, a name derived from the namespace's secret) before the task is submitted.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field

from distributed import Client, Future, wait

from .. import keys
from ..dask_internals import worker_resources
from ..errors import WorkflowError
from ..runtime.plugin_client import gather
from .spec import Tool

MAX_HISTORY = 64  # durations kept per tool (newest last)


@dataclass(frozen=True, slots=True)
class ToolOutput:
    text: str  # what agents that read the tool see
    seconds: float  # the function's run time on the worker
    worker: str  # where it ran


def run_tool(fn, args: tuple, texts: list[str], render) -> ToolOutput:
    """On a worker: ``fn(*args, *texts)``, rendered to text (``render`` or ``str``).

    The task leaves the worker's thread pool first (``secede``, as a KV task does while its
    step loop runs): a tool mostly waits (an API, a search service, a sandbox), and the
    model tasks queued on its worker must not wait behind it."""
    from distributed import get_worker, secede

    try:
        worker = get_worker().address
        secede()
    except ValueError:  # not in a worker (a test calling it directly)
        worker = ""
    t0 = time.perf_counter()
    value = fn(*args, *texts)
    text = render(value) if render is not None else value if isinstance(value, str) else str(value)
    if not isinstance(text, str):
        raise TypeError(f"a tool's render must return str, got {type(text).__name__}")
    return ToolOutput(text, time.perf_counter() - t0, worker)


def history_key(tool: Tool) -> str:
    """Calls of one tool share durations: a ReAct step's calls of ``calculator`` are one tool."""
    return f"{tool.kind}:{getattr(tool.fn, '__name__', type(tool.fn).__name__)}"


class ToolHistory:
    """The measured durations of each tool, in this process (every run, every mode)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._durations: dict[str, deque[float]] = {}

    def record(self, key: str, seconds: float) -> None:
        with self._lock:
            self._durations.setdefault(key, deque(maxlen=MAX_HISTORY)).append(float(seconds))

    def durations(self, key: str) -> tuple[float, ...]:
        with self._lock:
            return tuple(self._durations.get(key, ()))

    def clear(self) -> None:
        with self._lock:
            self._durations.clear()


HISTORY = ToolHistory()
# Arguments scattered once per client (``shared``), by the client and the argument's own key.
_SHARED: weakref.WeakKeyDictionary[Client, dict[str, Future]] = weakref.WeakKeyDictionary()
_SHARED_LOCK = threading.Lock()


@dataclass(slots=True, eq=False)
class ToolCalls:
    """One run's tool calls: submitted, in flight, finished or failed."""

    client: Client  # submits the tasks
    namespace: str  # tags their keys
    key_digest: str  # the namespace's secret digest (names derived from it, e.g. a memory's)
    submitted_at: dict[str, float] = field(default_factory=dict)  # name -> time.time() of the submit
    _futures: dict[str, Future] = field(default_factory=dict)  # name -> its task, while in flight
    _resources: dict | None = None  # every worker's resources, asked once per run

    def check(self, tool: Tool) -> None:
        """A tool whose resources no worker has: one line now, not a task parked for good."""
        if not tool.resources:
            return
        if self._resources is None:
            self._resources = worker_resources(self.client)
        fits = [w for w, have in self._resources.items()
                if all(have.get(r, 0) >= amount for r, amount in tool.resources.items())]
        if not fits:
            raise WorkflowError(f"tool {tool.name!r} needs resources {tool.resources}, which no worker of this "
                                f"cluster has (workers: {self._resources or 'none'})")

    def shared(self, ident: str, value) -> Future:
        """``value`` scattered to the cluster once per client (later calls reuse the future)."""
        with _SHARED_LOCK:
            held = _SHARED.setdefault(self.client, {})
            if ident not in held:
                [held[ident]] = self.client.scatter([value], hash=False)
            return held[ident]

    def submit(self, tool: Tool, texts: list[str]) -> None:
        self.check(tool)
        args = tuple(a.for_cluster(self) if hasattr(a, "for_cluster") else a for a in tool.args)
        self._futures[tool.name] = self.client.submit(
            run_tool, tool.fn, args, list(texts), tool.render, key=keys.tool_key(tool.name, self.namespace),
            resources=tool.resources, retries=tool.retries or None, pure=False)
        self.submitted_at[tool.name] = time.time()

    @property
    def pending(self) -> list[str]:
        return list(self._futures)

    def finished(self, timeout: float | None = 0) -> list[tuple[str, ToolOutput | None, BaseException | None]]:
        """The calls that finished, waiting up to ``timeout`` s (None: for good) for a first
        one: (name, output, None) or (name, None, the tool's own exception)."""
        if not self._futures:
            return []
        if timeout is None or timeout > 0:
            try:
                wait(list(self._futures.values()), timeout=timeout, return_when="FIRST_COMPLETED")
            except TimeoutError:
                pass
        out = []
        for name, fut in list(self._futures.items()):
            if not fut.done():
                continue
            del self._futures[name]
            try:
                [value] = gather(self.client, [fut])
                out.append((name, value, None))
            except Exception as e:  # noqa: BLE001 -- the tool's own error, handed to the run to report
                out.append((name, None, e))
        return out

    def cancel(self) -> None:
        """Stop waiting for what is in flight (a run given up)."""
        for fut in self._futures.values():
            fut.cancel()
        self._futures.clear()
