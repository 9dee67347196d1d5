"""Every piece of Dask daskflow-kv uses that has no public form, in one place.

Public API is used everywhere it exists (``SchedulerPlugin`` hooks, ``Client.register_plugin``,
``Scheduler.set_restrictions``, ``TaskState``/``WorkerState`` attributes a plugin reads). What
remains is below, one small function per assumption, and ``tests/test_dask_internals.py``
checks each one against the installed distributed: an upgrade that breaks one fails there,
with its name, instead of somewhere deep in a workflow. pyproject.toml pins distributed to
the range those tests passed on, and CI runs them on its oldest and newest release.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable, Collection, Iterable, Mapping

from distributed import Future
from distributed.scheduler import ClientState

logger = logging.getLogger("daskflow_kv.dask_internals")


# -- client side ------------------------------------------------------------------------------
def hold_futures(client, keys: Iterable) -> dict:
    """Futures for keys the scheduler has just made ``client`` want (``want`` below).

    Distributed builds futures for keys it did not submit the same way (``Variable.get``).
    Asking again on the client's ordered stream (the message ``fire_and_forget`` sends)
    makes the scheduler report each key's state to the futures that now exist - a report
    sent before they existed would be dropped - and overrides a release of an older
    future of the same key still in flight.
    """
    futures = {k: Future(k, client) for k in keys}
    if futures:
        client._send_to_scheduler({"op": "client-desires-keys", "keys": list(futures)})
    return futures


def worker_addresses(client) -> list[str]:
    """Every worker's address, asked of the scheduler now (sync client).

    Not ``client.scheduler_info(n_workers=-1)["workers"]``: that returns the client's cached
    identity, which its periodic refresh (``distributed.client.scheduler-info-interval``)
    overwrites with ``n_workers=0`` - no workers - so a read can race the refresh and see an
    empty cluster. Measured: a calibration probe reported "worker left the cluster" while
    the worker ran on, and that worker planned on a one-sample profile.
    """
    return sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def worker_resources(client) -> dict[str, dict[str, float]]:
    """Every worker's Dask resources (``{"search": 1}``), asked of the scheduler now, as
    ``worker_addresses``: a tool that needs resources no worker has is refused before it waits
    in ``no-worker`` for good."""
    workers = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
    return {w: dict(info.get("resources") or {}) for w, info in workers.items()}


def send_on_stream(client, msg: dict) -> None:
    """Send ``msg`` to a scheduler stream handler on ``client``'s own batched stream (the
    connection ``update-graph`` travels on), in order with everything else it sends there."""
    client._send_to_scheduler(msg)


_OWNED_CLUSTER = "_daskflow_owned_cluster"


def attach_owned_cluster(client, cluster) -> None:
    """Remember on ``client`` the cluster this process started for it (closed with it).

    Client has no place for caller data; an attribute of ours on the object keeps the
    cluster exactly as long as the client, with no registry to clean up.
    """
    setattr(client, _OWNED_CLUSTER, cluster)


def owned_cluster(client):
    """The cluster ``attach_owned_cluster`` remembered on ``client``; None when none was."""
    return getattr(client, _OWNED_CLUSTER, None)


def retiring_by_name(cluster_class: type, names: Callable[[set, Iterable], list], class_name: str) -> type:
    """A subclass of the SpecCluster class ``cluster_class`` whose scale-down first retires the
    workers it drops by their Dask worker names, ``names(dropped spec names, every worker's
    name)``, then goes on as Dask's own.

    SpecCluster's ``_correct_state_internal`` (its only scale step; no public hook) asks the
    scheduler to retire the dropped workers by *spec name* in the argument that takes
    addresses, so nothing is retired and the workers close with their keys still in memory:
    for a job of several workers (``name-0``, ``name-1``) every KV block on them is lost.
    """
    from distributed.core import Status

    class Retiring(cluster_class):
        async def _correct_state_internal(self) -> None:
            dropped = set(self.workers) - set(self.worker_spec)
            if dropped and self.scheduler.status == Status.running:
                retire = names(dropped, (w["name"] for w in self.scheduler_info["workers"].values()))
                if retire:
                    await self.scheduler_comm.retire_workers(names=retire)
            await super()._correct_state_internal()

    Retiring.__name__ = Retiring.__qualname__ = class_name
    return Retiring


# -- scheduler side: who is calling ---------------------------------------------------------------
def current_connection() -> asyncio.Task | None:
    """The connection the scheduler is serving at this moment, as an opaque object.

    Dask serves each comm in its own asyncio task: one client's (or worker's) batched
    stream is read for its whole life by one task, which runs every stream handler of that
    stream - and ``update-graph``, with the ``SchedulerPlugin.update_graph`` hooks it calls.
    The ``client=`` / ``worker=`` Dask hands a stream handler cannot say who sent a message:
    it is ``merge(extra, msg)``, so a message that names ``client`` overrides the stream's
    own. The task identity can't be forged from a message. None outside a task.
    """
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


def stream_client(scheduler) -> str | None:
    """The id of the client whose batched stream ``scheduler`` is serving at this moment (None
    on a worker's stream, in an RPC, outside any stream).

    Dask reads a client's stream inside ``Scheduler.add_client``, which awaits
    ``handle_stream`` until the client leaves, so every stream handler of that stream (and
    ``update_graph``) runs below that call's frame. Its ``client`` argument is the id the
    connection registered with; no message can change it, unlike the ``client=`` a stream
    handler is given (``merge(extra, msg)``: a message naming another client overrides it).
    So it is read from that frame of the running call stack.
    """
    from distributed.scheduler import Scheduler

    code = getattr(Scheduler.add_client, "__wrapped__", Scheduler.add_client).__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is scheduler:
            client = frame.f_locals.get("client")
            return client if isinstance(client, str) else None
        frame = frame.f_back
    return None


def connection_open(connection) -> bool:
    """The connection (``current_connection``) is still being served: its peer has not left."""
    return connection is not None and not connection.done()


# -- scheduler side -----------------------------------------------------------------------------
def add_stream_handlers(scheduler, handlers: Mapping) -> None:
    """Handlers for messages clients and workers send on their batched streams.

    Dask looks a stream message's op up in one table shared by clients and workers and
    raises on an unknown one, which closes that stream: a handler must exist before any
    peer sends its op, and must never raise (a bad message would end its sender's stream)."""
    scheduler.stream_handlers.update(handlers)


def add_handlers(scheduler, handlers: Mapping) -> None:
    """RPC handlers a client reaches with ``client.scheduler.<name>(...)``, as extensions add theirs."""
    scheduler.handlers.update(handlers)


def ensure_client(scheduler, name: str) -> None:
    """A scheduler-side pseudo-client that can want keys (Variable/Queue/publish use the same)."""
    scheduler.clients.setdefault(name, ClientState(name))


def want(scheduler, keys: Collection, client: str) -> None:
    """``client`` wants ``keys``: Dask keeps them (and recomputes them if lost) until released."""
    scheduler.client_desires_keys(list(keys), client)


def unwant(scheduler, keys: Collection, client: str, stimulus_id: str) -> None:
    scheduler.client_releases_keys(list(keys), client, stimulus_id=stimulus_id)


def pin(scheduler, ts, worker: str) -> None:
    """Run ``ts`` on ``worker`` only, while that worker lives (no stealing, no other worker).

    ``set_restrictions`` is public (the P2P shuffle's plugin uses it); strictness is the
    ``loose_restrictions`` flag, which has no setter.
    """
    scheduler.set_restrictions({ts.key: {worker}})
    ts.loose_restrictions = False


def loosen(ts) -> None:
    """Let ``ts`` run elsewhere when its workers are gone (Dask then recomputes its inputs)."""
    ts.loose_restrictions = True


def is_strict(ts) -> bool:
    return bool(ts.worker_restrictions) and not ts.loose_restrictions


def reschedule(scheduler, keys: Collection, stimulus_id: str) -> None:
    """Tasks stuck in no-worker whose restrictions were loosened: schedule them now."""
    scheduler.transitions({k: "processing" for k in keys}, stimulus_id=stimulus_id)


def fail_task(scheduler, key, exc: BaseException, stimulus_id: str) -> None:
    """Err a task that never ran (parked in no-worker) with ``exc``: its futures raise it.

    The same transition a worker's error report takes, fed with our exception; there is no
    public way to fail a task from the scheduler.
    """
    from distributed.protocol.serialize import to_serialize

    recs, client_msgs, worker_msgs = scheduler._transition(
        key, "erred", stimulus_id, cause=key, exception=to_serialize(exc), traceback=None,
        exception_text=f"{type(exc).__name__}: {exc}", traceback_text="",
    )
    scheduler._transitions(recs, client_msgs, worker_msgs, stimulus_id)
    scheduler.send_all(client_msgs, worker_msgs)


def refuse_new_tasks(scheduler, keys: Collection, exc: BaseException, stimulus_id: str) -> list:
    """From a ``SchedulerPlugin.update_graph`` hook: the graph's new tasks ``keys`` never run.

    Dask calls the hook after it made the graph's tasks (still ``released``: nothing was
    sent to a worker) and before it schedules them. Each refused task errs with ``exc`` -
    the clients that want it get that error, and its dependents in the graph err too, as
    when a task fails - and is then forgotten with them, so the key is free again for the
    task its owner submits (an erred key kept by the refused client's future would answer
    the owner's submission with this error). Tasks no longer ``released`` are left alone.
    -> the keys forgotten.
    """
    from distributed.protocol.serialize import to_serialize

    refused = [scheduler.tasks[k] for k in keys if k in scheduler.tasks and scheduler.tasks[k].state == "released"]
    if not refused:
        return []
    error, text = to_serialize(exc), f"{type(exc).__name__}: {exc}"
    for ts in refused:
        ts.exception, ts.exception_text, ts.traceback, ts.traceback_text = error, text, None, ""
        ts.exception_blame = ts
    scheduler.transitions({ts.key: "erred" for ts in refused}, stimulus_id)
    # Every task that erred with them (the refused ones and their dependents, transitively).
    erred, stack = {}, list(refused)
    while stack:
        ts = stack.pop()
        if ts.key in erred or ts.state != "erred":
            continue
        erred[ts.key] = ts
        stack.extend(ts.dependents)
    for ts in erred.values():
        for cs in list(ts.who_wants or ()):
            scheduler.client_releases_keys([ts.key], cs.client_key, stimulus_id)
    return [k for k, ts in erred.items() if scheduler.tasks.get(k) is not ts]


def wire_error(value) -> str | None:
    """Why Dask could not send ``value`` in a message (one line), or None when it can.

    What the scheduler sends a worker (``compute-task``: the key, its priority, its
    annotations) is packed with msgpack (``distributed.protocol.dumps``), pickling what
    msgpack does not know; an integer outside 64 bits, or a value nested too deep, raises
    instead - and Dask then drops the worker's whole stream (every client's tasks there
    lose their results). Packed here with msgpack and Dask's own encoder, an object Dask
    would pickle standing in as None (``dumps`` itself would log each failure as critical).
    """
    import msgpack
    from distributed.protocol.serialize import msgpack_encode_default

    def default(obj):
        if isinstance(obj, int):  # msgpack hands an int here only when it is outside 64 bits
            raise OverflowError("Integer value out of range")
        encoded = msgpack_encode_default(obj)
        return None if encoded is obj else encoded  # Dask pickles what msgpack does not know: it travels

    try:
        msgpack.dumps({"value": value}, default=default, use_bin_type=True)
    except Exception as e:  # noqa: BLE001 -- whatever it is, the value cannot travel
        return f"{type(e).__name__}: {e}"[:200]
    return None


def divert_worker_events(scheduler, topic: str, handler: Callable[..., None]) -> None:
    """What workers log to ``topic`` goes to ``handler(worker=..., msg=...)`` only, never to
    Dask's event log, which every client reads (``Client.get_events``, ``subscribe_topic``).

    ``Worker.log_event`` sends its message on the worker's batched stream (``log-event``);
    the scheduler's handler publishes it to the topic's subscribers and then the plugins'
    ``log_event`` hooks. Other topics pass through. ``handler`` must not raise (a raise ends
    the worker's stream); ``worker=`` is the message's, so check the stream it came on.
    """
    streams = scheduler.stream_handlers
    logged = getattr(streams["log-event"], "daskflow_kv_original", streams["log-event"])
    diverted_topic = topic

    def diverted(worker=None, topic=None, msg=None, **kwargs):
        if topic == diverted_topic:
            handler(worker=worker, msg=msg)
        else:
            logged(worker=worker, topic=topic, msg=msg, **kwargs)

    diverted.daskflow_kv_original = logged  # diverting again replaces this one, not wraps it
    streams["log-event"] = diverted


def strip_annotation(scheduler, task_states: Iterable, name: str) -> None:
    """Drop annotation ``name`` from new tasks before Dask ships them to workers.

    Dask sends a task's annotations to the worker that runs it (``compute-task``) and shows
    them on its task pages; ``dask.annotate`` values also land in the graph's
    ``Computation``. The scheduler plugin reads ours in its update_graph hook and needs
    them nowhere else. Call from that hook, before the tasks are scheduled.
    """
    for ts in task_states:
        if ts.annotations and name in ts.annotations:
            ts.annotations = {k: v for k, v in ts.annotations.items() if k != name}
    if scheduler.computations:
        scheduler.computations[-1].annotations.pop(name, None)


def guard_data_handlers(scheduler, refused: Callable[[Collection], BaseException | None]) -> None:
    """Refuse data a client puts on workers under keys ``refused`` objects to.

    ``Client.scatter`` enters data without a task: ``scatter`` and ``update_data`` (RPCs)
    and ``update-data`` (a client stream op) record it as in memory on the workers named,
    under the client's keys - a new key, or another replica of a key already computed,
    which a task on that worker would then read. ``refused(keys)`` returns the exception
    that says why, or None: an RPC raises it to its caller; the stream op drops those keys.
    The data itself reaches workers through their ``update_data`` (``guard_worker_data``).
    """
    handlers, streams = scheduler.handlers, scheduler.stream_handlers
    scatter, update_rpc, update_stream = handlers["scatter"], handlers["update_data"], streams["update-data"]
    if getattr(scatter, "daskflow_kv_guard", False):
        return

    async def guarded_scatter(*args, data=None, **kwargs):
        exc = refused(list(data or ()))
        if exc is not None:
            raise exc
        return await scatter(*args, data=data, **kwargs)

    def guarded_update_data(*, who_has, nbytes, client=None):
        exc = refused(list(who_has))
        if exc is not None:
            raise exc
        return update_rpc(who_has=who_has, nbytes=nbytes, client=client)

    def guarded_update_stream(*, who_has, nbytes, client=None):
        keep = {k: v for k, v in who_has.items() if refused([k]) is None}
        if len(keep) < len(who_has):
            logger.warning("daskflow-kv: refused data for %d key(s) from client %s", len(who_has) - len(keep), client)
        if keep:
            update_stream(who_has=keep, nbytes=nbytes, client=client)

    for fn in (guarded_scatter, guarded_update_data, guarded_update_stream):
        fn.daskflow_kv_guard = True
    handlers["scatter"], handlers["update_data"] = guarded_scatter, guarded_update_data
    streams["update-data"] = guarded_update_stream


def guard_worker_data(worker, refused: Callable[[Collection], BaseException | None]) -> None:
    """The worker's side of ``guard_data_handlers``: its ``update_data`` RPC (what
    ``Client.scatter`` sends the data with) refuses keys ``refused`` objects to, raising the
    exception to the caller. It would otherwise put the value in the worker's memory under
    that key - over a value a task computed there - and serve it to the next task that
    reads the key, or runs under it."""
    update = worker.handlers["update_data"]
    if getattr(update, "daskflow_kv_guard", False):
        return

    def guarded(data, stimulus_id=None):
        exc = refused(list(data))
        if exc is not None:
            raise exc
        return update(data=data, stimulus_id=stimulus_id)

    guarded.daskflow_kv_guard = True
    worker.handlers["update_data"] = guarded


def guard_task_finished(scheduler, refused: Callable[..., BaseException | None]) -> None:
    """Check what a worker says a task returned before the scheduler takes the result.

    A worker reports a finished task on its stream (``task-finished``, with the size it
    measured, ``nbytes``); Dask then holds the result in memory there. ``refused(key,
    worker, nbytes)`` returns the exception the task errs with instead, or None: the task
    then errs as if it had raised on the worker (``handle_task_erred``), and Dask's own
    handler, finding it erred, tells the worker to free the result. A ``refused`` that
    raises refuses too (a check must not let through what it could not check).
    """
    from distributed.protocol.serialize import to_serialize

    finished = scheduler.stream_handlers["task-finished"]
    finished = getattr(finished, "daskflow_kv_original", finished)

    def guarded(key=None, worker=None, stimulus_id=None, **msg):
        try:
            exc = refused(key, worker, msg.get("nbytes"))
        except Exception as e:  # noqa: BLE001 -- fail closed
            logger.exception("daskflow-kv: checking a finished task failed")
            exc = PermissionError(f"the result could not be checked ({type(e).__name__}); refused")
        ts = scheduler.tasks.get(key)
        if exc is not None and ts is not None and ts.state == "processing":
            logger.warning("daskflow-kv: a task's result was refused: %s", exc)
            scheduler.handle_task_erred(key=key, worker=worker, stimulus_id=stimulus_id, run_id=msg.get("run_id"),
                                        exception=to_serialize(exc), traceback=None,
                                        exception_text=f"{type(exc).__name__}: {exc}", traceback_text="")
        finished(key=key, worker=worker, stimulus_id=stimulus_id, **msg)

    guarded.daskflow_kv_original = finished  # guarding again replaces this one, not wraps it
    scheduler.stream_handlers["task-finished"] = guarded


async def call_worker_from_scheduler(scheduler, address: str, op: str, **kwargs):
    """One RPC from the scheduler to the handler ``op`` of the worker listening at ``address``
    (``add_worker_handlers``): it reaches that worker's own server, whoever asked for it."""
    return await getattr(scheduler.rpc(address), op)(**kwargs)


def unrunnable(scheduler) -> list:
    """Tasks parked in no-worker (no valid worker for their restrictions)."""
    return list(scheduler.unrunnable)


def paused_workers(scheduler) -> set[str]:
    """Workers Dask paused (process memory over ``distributed.worker.memory.pause``): they keep
    their data and serve it to others, but start no task."""
    from distributed.core import Status

    return {a for a, ws in scheduler.workers.items() if ws.status == Status.paused}


def is_paused(worker) -> bool:
    """Dask paused this worker (its process memory is over ``distributed.worker.memory.pause``)."""
    from distributed.core import Status

    return worker.status == Status.paused


def has_running_worker(scheduler) -> bool:
    """At least one worker is up and accepting tasks (not only connected)."""
    return bool(scheduler.running)


def running_workers(scheduler) -> list:
    """The workers up and accepting tasks (WorkerState objects), in no particular order."""
    return list(scheduler.running)


# -- scheduler side: Dask's history of task groups, kept bounded ---------------------------------
# Dask drops a TaskGroup from ``scheduler.task_groups`` once all its tasks are forgotten, but the
# span that saw it, and the deprecated ``Computation``, keep it for the scheduler's life, and a new
# default span is opened whenever the last one is done (dask/distributed#7977). A KV stream
# empties and re-creates its groups (``prefill``, ``kvresult-...``) with nearly every workflow, so
# a never-restarted scheduler grows by a span and its dead groups per workflow (~15 KiB measured).
def prune_dead_groups(scheduler) -> int:
    """Forget forgotten TaskGroups in the Computations and in the default spans that still hold
    a live one (a span's ``stop`` needs a group); -> how many references were dropped. User
    spans keep theirs: they end with the user's ``span`` block."""
    live = scheduler.task_groups

    def dead(groups) -> list:
        return [tg for tg in groups if live.get(tg.name) is not tg]

    dropped = 0
    for comp in scheduler.computations:
        gone = dead(comp.groups)
        comp.groups.difference_update(gone)
        dropped += len(gone)
    for span in default_spans(scheduler):
        gone = dead(span.groups)
        if len(gone) < len(span.groups):
            span.groups.difference_update(gone)
            dropped += len(gone)
    return dropped


def compact_span_metadata(scheduler) -> int:
    """Drop repeated entries from every span's metadata; -> how many were dropped.

    Each ``update_graph`` appends its collections' descriptions to its span's metadata -
    ``{"type": "Future"}`` for every ``client.submit`` - so a span that lives as long as the
    cache (the default span holding cached blocks) grows by one dict per KV task submitted
    (the soak: ~80 a second, most of the scheduler's growth). Identical entries say nothing
    more; the first of each is kept, in order. Releases that remember which metadata objects
    they took (a class-level set of ``id``s, ``Span._metadata_seen``) have it emptied too:
    it grows with every graph and only ever guards one ``update_graph`` call.
    """
    ext = scheduler.extensions.get("spans")
    if ext is None:
        return 0
    dropped = 0
    for span in ext.spans.values():
        meta = getattr(span, "_metadata", None)
        entries = meta.get("collections") if meta else None
        if not entries or len(entries) < 2:
            continue
        seen, kept = set(), []
        for e in entries:
            sig = repr(sorted(e.items())) if isinstance(e, dict) else repr(e)
            if sig not in seen:
                seen.add(sig)
                kept.append(e)
        dropped += len(entries) - len(kept)
        entries[:] = kept
    from distributed.spans import Span

    seen_ids = getattr(Span, "_metadata_seen", None)
    if isinstance(seen_ids, set):
        seen_ids.clear()
    return dropped


def default_spans(scheduler) -> list:
    """The spans Dask opened for tasks no ``span`` block names, oldest first."""
    ext = scheduler.extensions.get("spans")
    return list(ext.spans_search_by_name.get(("default",), ())) if ext is not None else []


def span_is_dead(scheduler, span) -> bool:
    """``span`` is a childless default span whose every group the scheduler has forgotten."""
    live = scheduler.task_groups
    return not span.children and all(live.get(tg.name) is not tg for tg in span.groups)


def drop_spans(scheduler, spans) -> None:
    """Remove dead default spans from the spans extension's indexes. A worker heartbeat that
    still names one fails and the worker closes itself, so callers wait until every worker
    has sent a heartbeat collected after the span died (``oldest_heartbeat``)."""
    ext = scheduler.extensions["spans"]
    gone = {id(sp) for sp in spans}
    for sp in spans:
        ext.spans.pop(sp.id, None)
    for index in (ext.root_spans, *ext.spans_search_by_name.values(), *ext.spans_search_by_tag.values()):
        index[:] = [sp for sp in index if id(sp) not in gone]


# -- scheduler side: its dashboard ------------------------------------------------------------------
def dashboard_template_variables(scheduler) -> dict | None:
    """The variables Dask's Bokeh dashboard renders every page with (``pages``: the navigation
    bar, ``plots``: the "More..." menu); None when no Bokeh dashboard can run.

    ``distributed.dashboard.scheduler.template_variables`` is memoized per scheduler and its
    lists are shared with every page's template, so an entry appended to them shows on
    every dashboard page rendered afterwards: the only way to add a page to Dask's menus.
    """
    try:
        from distributed.dashboard.scheduler import template_variables

        return template_variables(scheduler)
    except Exception:  # noqa: BLE001 -- no Bokeh (or no dashboard module): no menus to read or extend
        return None


def prometheus_handler_base() -> type:
    """Dask's scheduler ``/metrics`` request handler, to subclass (it lives in a module Dask
    does not document; the class is what ``/metrics`` routes to)."""
    from distributed.http.scheduler.prometheus.core import PrometheusHandler

    return PrometheusHandler


def span_history_size(scheduler) -> tuple[int, int]:
    """Spans the scheduler's spans extension keeps, and the task groups they hold (the
    history ``prune_dead_groups``/``drop_spans`` keep bounded); (0, 0) without the extension."""
    ext = scheduler.extensions.get("spans")
    spans = list(ext.spans.values()) if ext is not None else []
    return len(spans), sum(len(sp.groups) for sp in spans)


def oldest_heartbeat(scheduler) -> float:
    """When the worker heard from least recently last sent a heartbeat (now without workers)."""
    import time

    return min((ws.last_seen for ws in scheduler.workers.values()), default=time.time())


def recent_transitions(scheduler, n: int) -> list[tuple] | None:
    """The scheduler's last ``n`` task transitions, oldest first, as (key, start, finish,
    stimulus_id); None when its log (``distributed.admin.low-level-log-length`` entries,
    1000 by default) no longer holds them all."""
    log = list(scheduler.transition_log)
    if n > len(log):
        return None
    return [(t.key, t.start, t.finish, t.stimulus_id) for t in log[len(log) - n:]]


def drop_replica(scheduler, worker: str, keys: Collection, stimulus_id: str) -> None:
    """Forget ``worker``'s copy of keys other workers also hold (what the AMM asks for)."""
    scheduler.request_remove_replicas(worker, list(keys), stimulus_id=stimulus_id)


def link_bandwidths(scheduler) -> dict[tuple[str, str], float]:
    """Dask's running estimate per worker pair, as {(sender, receiver): bytes/s}.

    ``Scheduler.bandwidth_workers`` is keyed (receiver, sender): each worker reports the
    bandwidth of what it fetched from every other one.
    """
    return {(src, dst): bw for (dst, src), bw in scheduler.bandwidth_workers.items()}


async def install_worker_plugin(scheduler, plugin) -> None:
    """Install ``plugin`` on every worker, present and future, from inside the scheduler.

    What ``Client.register_plugin`` does for a WorkerPlugin, minus the client: the
    scheduler keeps the pickled plugin and sends it to workers as they join. Idempotent by
    the plugin's ``name``.
    """
    from distributed.protocol.pickle import dumps

    await scheduler.register_worker_plugin(None, dumps(plugin), name=plugin.name, idempotent=True)


def replace_amm_policy(scheduler, old_type: type, new) -> bool:
    """Swap the Active Memory Manager's ``old_type`` policy for ``new``; False without an AMM."""
    amm = scheduler.extensions.get("amm")
    if amm is None:
        return False
    for policy in list(amm.policies):
        if type(policy) is old_type:
            amm.policies.discard(policy)
            amm.add_policy(new)
    return True


# -- worker side --------------------------------------------------------------------------------
def incoming_transfers(worker) -> list[dict]:
    """The worker's record of what it fetched: start, stop, duration, total bytes, keys, who."""
    return list(worker.transfer_incoming_log)


def clear_incoming_transfers(worker) -> None:
    worker.transfer_incoming_log.clear()


def add_worker_handlers(worker, handlers: Mapping) -> None:
    """RPC handlers another worker reaches with ``call_worker`` (a task-to-task channel).

    ``Worker.handlers`` is read per message, so handlers added after start are served.
    """
    worker.handlers.update(handlers)


async def call_worker(worker, address: str, op: str, **kwargs):
    """One RPC from ``worker`` to ``address``'s handler ``op``, over the worker's pooled comms."""
    return await getattr(worker.rpc(address), op)(**kwargs)


def worker_loop(worker):
    """The asyncio loop of a worker's server, where its comms live (tasks run in other threads)."""
    return worker.loop.asyncio_loop


def in_memory(worker):
    """The worker's results that are in memory now (not spilled): a key -> value mapping.

    ``Worker.data`` is a plain dict, or a zict Buffer whose ``fast`` part is what is in
    memory; reading a spilled key through ``data`` would load it back from disk.
    """
    return getattr(worker.data, "fast", worker.data)


def bytes_spilled_to_disk(worker) -> int:
    """Bytes the worker's SpillBuffer has written to disk since it started, all keys together
    (0 without spilling).

    The buffer's cumulative metrics count a spill that was read back and released before
    anyone looked: the heartbeat's ``spilled_bytes`` is only what sits on disk at that
    moment, and a short run can spill and unspill between two.
    """
    metrics = getattr(worker.data, "cumulative_metrics", None) or {}
    return int(metrics.get(("disk-write", "bytes"), 0))


def spilled_keys(worker) -> list:
    """Keys the worker's SpillBuffer holds on disk (its ``slow`` part); [] without spilling.

    Listed under the buffer's lock: a task thread may be spilling while we read.
    """
    data = worker.data
    slow = getattr(data, "slow", None)
    if slow is None:
        return []
    lock = getattr(data, "lock", None)
    if lock is None:
        return list(slow.keys())
    with lock:
        return list(slow.keys())


def can_spill(worker) -> bool:
    """The worker keeps its results in a SpillBuffer (memory, then disk): keys can be spilled."""
    return hasattr(getattr(worker.data, "fast", None), "evict") and hasattr(worker.data, "slow")


def spill_keys(worker, keys: Collection) -> list:
    """Move ``keys`` from the worker's memory to its spill disk now; -> those moved.

    Dask's SpillBuffer spills its least recently used keys when the worker passes its memory
    target; zict's LRU also evicts one named key (``LRU.evict(key)``), which writes it to the
    buffer's ``slow`` part as the buffer's own spilling does. A key that fails to spill (disk
    full, ``max-spill`` reached) stays in memory, as Dask leaves it then. Reading the key
    later (a task's input, a peer's fetch) loads it back.
    """
    if not can_spill(worker):
        return []
    data, moved = worker.data, []
    for key in keys:
        if key not in data.fast:
            continue
        try:
            with data._capture_metrics():  # counted in the buffer's disk-write metrics, as its own spills
                data.fast.evict(key)
        except Exception as e:  # noqa: BLE001 -- Dask's own spilling keeps the value in memory then too
            logger.warning("daskflow-kv could not spill %s: %s", str(key)[:40], e)
            continue
        moved.append(key)
    return moved


def keep_spilled_on_peer_reads(worker, keeps: Callable[[object], bool]) -> None:
    """A peer's fetch of a key this worker holds on its spill disk leaves it on disk (for
    the keys ``keeps`` names).

    Dask's ``get_data`` reads ``worker.data[key]``, and a SpillBuffer read moves the value
    back into memory, where it stays: a block the KV budget spilled for room here came back
    the moment a task on another worker fetched it, and the worker held KV past its budget
    with nothing the budget had admitted. The value is spilled again once it is sent (the
    peer has its copy; this one was only the transfer's buffer).
    """
    get_data = worker.handlers["get_data"]
    get_data = getattr(get_data, "daskflow_kv_original", get_data)

    async def get_data_keeping_spilled(comm, keys=(), **msg):
        slow = getattr(worker.data, "slow", None)
        spilled = [k for k in keys if keeps(k) and k in slow] if slow is not None else []
        try:
            return await get_data(comm, keys=keys, **msg)
        finally:
            if spilled:
                spill_keys(worker, spilled)

    get_data_keeping_spilled.daskflow_kv_original = get_data  # installing again replaces, not wraps
    worker.handlers["get_data"] = get_data_keeping_spilled


def gather_one_key_per_message(worker) -> None:
    """This worker asks a peer for one key per message (one ``get_data`` call each).

    Dask gathers all the keys it needs from one peer in one message, up to
    ``distributed.worker.transfer.message-bytes-limit`` (50 MB): a peer holding them on its
    spill disk loads them all, and holds them in memory at once while it sends them - a
    document's blocks past its KV budget for the length of the send. One key a message
    stages one block at a time. (Dask still sends a first key whatever its size, for
    progress; it fetches from one peer at a time, so a peer stages at most one block for
    each worker fetching from it.)
    """
    worker.state.transfer_message_bytes_limit = 1


def add_worker_stream_handlers(worker, handlers: Mapping) -> None:
    """Handlers for messages the scheduler sends on its batched stream to ``worker``
    (``send_to_worker_stream``). Run in the worker's event loop, in the order the scheduler
    sent them among its own messages (a compute-task sent after one comes after it)."""
    worker.stream_handlers.update(handlers)


def send_to_worker_stream(scheduler, worker: str, msg: dict) -> None:
    """Send ``msg`` on the scheduler's batched stream to ``worker`` (``add_worker_stream_handlers``)."""
    scheduler.worker_send(worker, msg)


def task_abandoned(worker, key) -> bool:
    """The task ``key`` running on ``worker`` is no longer wanted: its future was cancelled or
    released while it ran (the worker marks it ``cancelled``), or the worker forgot it.

    A running task cannot be interrupted by Dask; a task that waits (here: for the step
    loop) polls this to give its place back early.
    """
    ts = worker.state.tasks.get(key)
    return ts is None or ts.state in ("cancelled", "released", "forgotten")


def send_to_scheduler_stream(worker, msg: dict) -> None:
    """Send ``msg`` to a scheduler stream handler on the worker's own batched stream (the
    connection its task results travel on): the handler runs with ``worker=`` that stream's."""
    worker.batched_stream.send(msg)


def running_task_key():
    """The key of the task this worker thread is running (None outside a task)."""
    from distributed.worker import thread_state

    return getattr(thread_state, "key", None)


async def call_scheduler(worker, name: str, /, **kwargs):
    """An RPC from a worker to a scheduler handler (``add_handlers``), over the worker's own
    connection pool to its scheduler."""
    return await getattr(worker.scheduler, name)(**kwargs)


def drop_spawn_env(nanny, names) -> None:
    """Remove ``names`` from the environment ``nanny`` spawns its worker with.

    Dask copies ``distributed.nanny.pre-spawn-environ`` into ``Nanny.pre_spawn_env`` (and
    merges it into ``Nanny.env``) as the nanny is built, from the config of the process the
    nanny runs in - a Slurm job's, not ours - and spawns the worker after the nanny's
    preloads start: a nanny preload is where a job's worker can still be spared them.
    """
    for attr in ("pre_spawn_env", "env"):
        env = getattr(nanny, attr, None)
        if isinstance(env, dict):
            for name in names:
                env.pop(name, None)
