"""A workflow run passes the cluster's workflow gate before it submits anything.

The scheduler plugin keeps the line (``plugins/kv_gate.py``; the limit is
``daskflow-kv.scheduler.workflow-gate``, running runs per worker). Every run enters, with a
limit or not, so a limit set while the cluster serves counts the runs already inside. The
wait is asked for in short calls, so a run whose scheduler is gone hears of it (as
``SchedulerLost``) instead of waiting for ever; the run leaves when it ends, however it ends.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from .plugin_client import PluginClient

logger = logging.getLogger("daskflow_kv.runtime")

POLL_S = 5.0  # longest one call waits in line before the runtime asks again


@contextmanager
def admitted(plugin: PluginClient, run: str, poll_s: float = POLL_S) -> Iterator[float]:
    """Inside, run ``run`` is let in by the workflow gate; yields the seconds it waited."""
    t0 = time.perf_counter()
    try:
        while not plugin.gate_enter(run, poll_s)["admitted"]:
            pass
        yield time.perf_counter() - t0
    finally:
        try:
            plugin.gate_leave(run)
        except Exception as e:  # noqa: BLE001 -- its client leaving frees the place too
            logger.debug("daskflow-kv: run %s did not leave the workflow gate: %s", run, e)
