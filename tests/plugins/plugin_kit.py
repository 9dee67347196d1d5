"""Real pieces for the scheduler plugin's tests: the plugin registered on a gen_cluster
scheduler, a session, KV blocks and KV compute tasks submitted with the annotations a
KVRuntime gives them, and gates that hold a task on its worker until the test opens them.

No model: a block's value is a byte array of the size the test wants the budget to see
(``dask.sizeof`` of a NumPy array is its ``nbytes``).
"""

from __future__ import annotations

import asyncio
import copy
import secrets
import threading
import time

import dask
import numpy as np

from daskflow_kv import config
from daskflow_kv.keys import PLUGIN_NAME, PREFILL, block_key, task_key
from daskflow_kv.plugins.kv_scheduler import KVSchedulerPlugin
from daskflow_kv.runtime.session import login_async

BLOCK_TOKENS = 4  # tokens per test block
FINGERPRINT = "fingerprint-plugin-tests"
_GATES: dict[str, threading.Event] = {}  # gate name -> event a task waits on (workers run in-process)
_NAMESPACES: dict[str, str] = {}  # session token -> its namespace (whose tag the test's keys carry)


def kv_config(**overrides) -> dict:
    """gen_cluster's ``config``: daskflow-kv's shipped defaults, then ``overrides`` (dotted keys
    under daskflow-kv). gen_cluster resets dask.config to what it was when distributed.utils_test
    was imported, which may predate daskflow_kv.config registering its defaults."""
    out = {config.NAMESPACE: copy.deepcopy(config.defaults[config.NAMESPACE])}
    out.update({f"{config.NAMESPACE}.{k}": v for k, v in overrides.items()})
    return out


async def start_plugin(scheduler, **settings) -> KVSchedulerPlugin:
    """Register a KVSchedulerPlugin the way ``dask scheduler --preload`` does."""
    plugin = KVSchedulerPlugin(**settings)
    await scheduler.register_scheduler_plugin(plugin, name=PLUGIN_NAME, idempotent=True)
    assert scheduler.plugins[PLUGIN_NAME] is plugin
    return plugin


async def login(client, namespace: str = "tests", secret: str | None = None) -> str:
    """A session token, logged in as a KVRuntime does (an admin's on an open cluster: no tenants
    configured). Keys submitted with it carry its namespace's tag."""
    token = (await login_async(client, namespace, secret)).token
    _NAMESPACES[token] = namespace
    return token


def kv_value(nbytes: int, *inputs) -> np.ndarray:
    return np.zeros(nbytes, dtype=np.uint8)


def submit_block(client, session: str, worker: str, nbytes: int, start: int = 0, parent: str | None = None,
                 state_id: str = "kvstate-test-000000000000", fn=None, key: str | None = None, source=None):
    """A cataloged block of ``nbytes`` on ``worker``, chained after ``parent`` (``session``'s
    namespace's); ``fn``: its task body (default ``kv_value``); ``key``: a known content address;
    ``source``: the compute task's future it is cut from."""
    key = key or block_key(secrets.token_hex(16), _NAMESPACES[session])
    meta = {"key": key, "start": start, "end": start + BLOCK_TOKENS, "nbytes": nbytes,
            "tokens": list(range(start, start + BLOCK_TOKENS)), "parent": parent, "fingerprint": FINGERPRINT,
            "root": FINGERPRINT, "state_id": state_id}
    with dask.annotate(kv={"role": "block", "meta": meta}):
        return client.submit(fn or kv_value, nbytes, *([source] if source is not None else []), key=key,
                             workers=[worker], pure=False)


def submit_compute(client, session: str | None, target: str, fn=kv_value, *args, kv_out: int = 0,
                   predicted_s: float | None = None, workers: list[str] | None = None, flow: str | None = None):
    """A KV compute task (a prefill's output key of ``session``'s namespace) the plan sends to
    ``target``; ``flow``: the workflow run it serves."""
    note = {"role": "compute", "op": "prefill", "state_id": "kvstate-prefill-test",
            "target": target, "reads": [], "decision": None, "first": False, "kv_out": kv_out}
    if predicted_s is not None:
        note["predicted_s"] = predicted_s
    if flow is not None:
        note["flow"] = flow
    with dask.annotate(kv=note):
        return client.submit(fn, *args, key=task_key(PREFILL, _NAMESPACES.get(session, ""), "test"),
                             workers=workers or [target], pure=False)


def gate(name: str) -> threading.Event:
    _GATES[name] = threading.Event()
    return _GATES[name]


def wait_at_gate(name: str, *deps, nbytes: int = 0):
    """A task body that holds its worker's thread until the test opens gate ``name``."""
    if not _GATES[name].wait(timeout=30):
        raise TimeoutError(f"gate {name} never opened")
    return kv_value(nbytes)


async def until(condition, timeout: float = 10.0, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def state_of(scheduler, key) -> str | None:
    """The scheduler's state of ``key`` (None before its graph arrives or after it is forgotten)."""
    ts = scheduler.tasks.get(key)
    return None if ts is None else ts.state


def wanted_only_by_cache(scheduler, key) -> bool:
    """The client let go of ``key``: only the plugin's cache still wants it."""
    from daskflow_kv.keys import CACHE_CLIENT

    ts = scheduler.tasks.get(key)
    return ts is not None and {cs.client_key for cs in ts.who_wants or ()} == {CACHE_CLIENT}


def passthrough(*values):
    """A task body that returns its last input (a consumer of a block or a gate)."""
    return values[-1] if values else None


def events(plugin, op: str) -> list[dict]:
    """The plugin's lifecycle events of kind ``op``, oldest first."""
    return [e for e in plugin.event_log.events() if e["op"] == op]
