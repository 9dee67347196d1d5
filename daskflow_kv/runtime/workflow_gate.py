"""A workflow run passes the cluster's workflow gate before it submits anything.

The scheduler plugin keeps the line (``plugins/kv_gate.py``; the limit is
``daskflow-kv.scheduler.workflow-gate``, running runs per worker). Every run enters, with a
limit or not, so a limit set while the cluster serves counts the runs already inside. The
wait is asked for in short calls, so a run whose scheduler is gone hears of it (as
``SchedulerLost``) instead of waiting for ever. Inside, a thread renews the run's place
every ``RENEW_S``: a run whose process or thread died, or whose leave was lost, loses its
place within three renewals instead of holding it for ever. The run leaves when it ends,
however it ends. A run the KV budget preempted to break a deadlock is sent back to the head
of its line (``plugins/kv_gate.py``): it ``wait_turn``s again before it retries.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import ClientClosed
from ..policy.workflow_gate import RENEW_S
from .plugin_client import PluginClient

logger = logging.getLogger("daskflow_kv.runtime")

POLL_S = 5.0  # longest one call waits in line before the runtime asks again


@contextmanager
def admitted(plugin: PluginClient, run: str, poll_s: float = POLL_S, renew_s: float = RENEW_S) -> Iterator[float]:
    """Inside, run ``run`` is let in by the workflow gate; yields the seconds it waited."""
    t0 = time.perf_counter()
    inside = threading.Event()  # set when the run ends: the renewals stop
    try:
        wait_turn(plugin, run, poll_s)
        threading.Thread(target=_renew, args=(plugin, run, renew_s, inside), name=f"daskflow-kv-gate-{run[:24]}",
                         daemon=True).start()
        yield time.perf_counter() - t0
    finally:
        inside.set()
        try:
            plugin.gate_leave(run)
        except ClientClosed:  # the scheduler frees a client's places when the client leaves
            logger.debug("daskflow-kv: run %s ended after its client closed", run)
        except Exception as e:  # noqa: BLE001 -- its renewals stop: the place comes free within three
            logger.warning("daskflow-kv: run %s did not leave the workflow gate (its place frees itself within "
                           "%.0f s): %s", run, 3 * renew_s, e)


def wait_turn(plugin: PluginClient, run: str, poll_s: float = POLL_S) -> None:
    """Wait in the gate's line until run ``run`` is let in (at once when it is inside)."""
    while not plugin.gate_enter(run, poll_s)["admitted"]:
        pass


def _renew(plugin: PluginClient, run: str, every: float, ended: threading.Event) -> None:
    while not ended.wait(every):
        try:
            # Not inside: sent back to the line (it waits its turn again), or it lost its
            # place in a long stall (it goes on, uncounted). Either way only renewals stop.
            plugin.gate_enter(run, 0, renew=True)
        except Exception as e:  # noqa: BLE001 -- the run itself hears of a lost scheduler
            logger.debug("daskflow-kv: run %s could not renew its place in the workflow gate: %s", run, e)
