"""The plugin's lifecycle events and cost-model decisions: kept here, shown per namespace.

Every event (materialize, fork, resume, extend, merge, transfer, recompute, evict, lost,
release, ...) is kept, with its namespace, in a bounded log the client API scopes per tenant
(``kv_counters``, behind a session) and the dashboard reads.

Dask's own event log is read by every client, logged in or not (``client.get_events``,
``subscribe_topic``). An event there tells who prefilled what: namespace names, state ids,
prompt lengths, cached-prefix lengths, timings - the cached-prefix side channel given away.
So only an open scheduler (no tenants: one trust domain) also publishes its events there,
under ``EVENT_TOPIC`` and with keys cut short (``keys.short_key``: a full block key is a
capability to fetch the block's K/V); with tenants, nothing of them goes there.
"""

from __future__ import annotations

import time
from collections import deque

from daskflow_kv.keys import EVENT_TOPIC, short_key


def public_event(event: dict) -> dict:
    """An event as a reader outside its namespace may see it: keys cut short."""
    out = dict(event)
    if "key" in out:
        out["key"] = short_key(str(out["key"]))
    if "keys" in out:
        out["keys"] = [short_key(str(k)) for k in out["keys"]]
    return out


def _visible(entry: dict, namespace: str | None) -> bool:
    """``namespace`` (None: the operator, who sees all) sees its own and the cluster's own."""
    return namespace is None or entry.get("namespace") in (None, namespace)


class EventLog:
    __slots__ = ("_scheduler", "_public", "_events", "_decisions")

    def __init__(self, scheduler, max_events: int = 1024, max_decisions: int = 256, public: bool = True):
        self._scheduler = scheduler  # whose Dask event log gets the public copy
        self._public = public  # copy events to Dask's event log (an open scheduler only)
        self._events: deque[dict] = deque(maxlen=max_events)  # recent lifecycle events, newest last
        self._decisions: deque[dict] = deque(maxlen=max_decisions)  # recent cost-model decisions, newest last

    def record(self, op: str, namespace: str | None, **detail) -> None:
        """A lifecycle event of ``namespace`` (None: the cluster's own)."""
        event = {"op": op, "time": time.time(), "namespace": namespace, **detail}
        self._events.append(event)
        if self._public:
            self._scheduler.log_event(EVENT_TOPIC, public_event(event))

    def record_decision(self, decision: dict, namespace: str | None) -> None:
        """A placement the cost model chose (reuse, transfer, recompute), with its numbers."""
        self._decisions.append({**decision, "namespace": namespace})

    def events(self, namespace: str | None = None, last: int | None = None, public: bool = False) -> list[dict]:
        """The events ``namespace`` may see, oldest first (``last``: only the newest so many);
        ``public``: with keys cut short."""
        out = [e for e in self._events if _visible(e, namespace)]
        out = out[-last:] if last else out
        return [public_event(e) for e in out] if public else [dict(e) for e in out]

    def decisions(self, namespace: str | None = None, last: int | None = None, public: bool = False) -> list[dict]:
        """The decisions ``namespace`` may see, oldest first (``last``: only the newest so many);
        ``public``: with keys cut short."""
        out = [d for d in self._decisions if _visible(d, namespace)]
        out = out[-last:] if last else out
        return [public_event(d) if public else dict(d) for d in out]
