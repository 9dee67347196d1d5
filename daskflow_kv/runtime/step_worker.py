"""The worker side of continuous batching: one step loop per model per worker process.

A KV task (a prefill, a batch of forks, a text-mode generation) hands its requests to its
worker's ``StepEngine`` and leaves Dask's thread pool while they run (``secede``): the
worker then starts its other KV tasks at once, and their requests join the same running
batch at the next step, whichever workflow or client they come from. The task polls
whether Dask still wants it; a cancelled or released task takes its requests out of the
batch at the next step. Its result is what ``ModelRunner.run`` would have returned.

Settings: ``daskflow-kv.batching.step-tokens`` (a step's token budget: decode rows plus
prefill chunks), ``daskflow-kv.batching.max-running`` (requests in a batch at most) and
``daskflow-kv.batching.pool-bytes`` (the decode lane pool's tensors at most, ``model.lane_pool``).
"""

from __future__ import annotations

import atexit
import threading
from concurrent.futures import CancelledError, Future
from concurrent.futures import wait as wait_futures

from .. import config
from .. import dask_internals as di
from ..model.runner import ModelRunner, RunOutput
from ..model.step_engine import StepEngine, StepRequest

_ENGINES: dict[int, StepEngine] = {}  # id(runner) -> its engine (runners live for the process)
_LOCK = threading.Lock()
_THREAD = threading.local()  # .seceded: this task thread already left the pool (a thread secedes once)
POLL_S = 0.2  # how often a waiting task asks whether Dask still wants it


def engine_for(runner: ModelRunner) -> StepEngine:
    """This process's step loop for ``runner``'s model, started on first use."""
    with _LOCK:
        eng = _ENGINES.get(id(runner))
        if eng is None or eng.runner is not runner:
            eng = _ENGINES[id(runner)] = StepEngine(runner, int(config.get("batching.step-tokens")),
                                                    int(config.get("batching.max-running")),
                                                    config.get_bytes("batching.pool-bytes"))
        return eng


@atexit.register
def _stop_all() -> None:
    """At exit, end the step loops between steps: a daemon thread still inside a forward when
    the interpreter finalizes can end the process with "terminate called without an active
    exception"."""
    with _LOCK:
        engines = list(_ENGINES.values())
    for eng in engines:
        eng.stop(timeout=5.0)


def engine_stats() -> dict[str, dict]:
    """Every step loop of this process: ``EngineStats.as_dict()`` by "<model id>#<n>" (two
    runtimes of one model, with other block sizes, run a loop each: keyed by model id alone,
    one loop's counts hid the other's)."""
    with _LOCK:
        return {f"{e.runner.fingerprint.model_id}#{i}": e.stats.as_dict() for i, e in enumerate(_ENGINES.values())}


def engine_gauges() -> tuple[float, int, int, int]:
    """This process's step loops together: (busy seconds since start, requests running,
    requests waiting to join, KV bytes their working caches hold: 0 where a loop does not say)."""
    with _LOCK:
        engines = list(_ENGINES.values())
    kv = sum(e.kv_bytes() for e in engines if hasattr(e, "kv_bytes"))
    return (sum(e.busy_now() for e in engines), sum(e.stats.running for e in engines),
            sum(e.stats.waiting for e in engines), kv)


def recent_steps() -> list:
    """The shapes of the last steps of this process's step loops (``StepEngine.recent``), oldest first."""
    with _LOCK:
        engines = list(_ENGINES.values())
    return [s for e in engines for s in list(e.recent)]


def prompt_tokens_by_op() -> dict[str, dict[str, int]]:
    """Prompt tokens this process's step loops fed since start, by the operator of their
    request: ``{"fed": {op: n}, "dropped": {op: n}}`` (dropped: fed for a request that left
    without a result, cancelled or failed)."""
    with _LOCK:
        engines = list(_ENGINES.values())
    out: dict[str, dict[str, int]] = {"fed": {}, "dropped": {}}
    for e in engines:
        for kind, counts in (("fed", e.prompt_fed), ("dropped", e.prompt_dropped)):
            for op, n in dict(counts).items():  # a dict copy: the loop thread may add an op meanwhile
                out[kind][op] = out[kind].get(op, 0) + n
    return out


def run(runner: ModelRunner, requests: list[StepRequest], shared_prefix: bool = False) -> list[RunOutput]:
    """Run ``requests`` in the step loop and wait for them, outside the worker's thread pool."""
    eng = engine_for(runner)
    futures = eng.submit(requests, shared_prefix)
    worker, key = _current_task()
    if worker is not None and not getattr(_THREAD, "seceded", False):
        from distributed import secede

        secede()  # the worker starts its next task now; its requests join this batch
        _THREAD.seceded = True  # a seceded thread ends with its task: it never runs another
    return _wait(eng, futures, worker, key)


def _current_task():
    try:
        from distributed import get_worker

        worker = get_worker()
        return worker, worker.get_current_task()
    except ValueError:  # called outside a Dask task (in-process use, tests)
        return None, None


def _wait(eng: StepEngine, futures: list[Future], worker, key) -> list[RunOutput]:
    pending = set(futures)
    while pending:
        _, pending = wait_futures(pending, timeout=POLL_S)
        if pending and worker is not None and di.task_abandoned(worker, key):
            for f in pending:
                eng.cancel(f)
            raise CancelledError(f"task {key} was cancelled; its requests left the batch")
    return [f.result() for f in futures]
