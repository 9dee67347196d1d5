"""Calibration never waits on a dead worker: a lost probe is cancelled and that pair skipped."""

import contextlib
import os
import threading
import time

import pytest
from distributed import Client

from daskflow_kv.runtime import tasks
from daskflow_kv.runtime.calibration import ProbeLost, settle
from daskflow_kv.runtime.cluster import local_cluster, wait_for_restarts
from daskflow_kv.runtime.kv_runtime import KVRuntime


def test_a_probe_for_a_worker_that_is_gone_is_cancelled_at_once(client):
    gone = "tcp://127.0.0.1:9"  # nothing listens there
    fut = client.submit(tasks.probe_bytes, 1024, workers=[gone], allow_other_workers=False, pure=False)
    t0 = time.time()
    with pytest.raises(ProbeLost, match="left the cluster"):
        settle(client, [fut], [gone], timeout=30)
    assert time.time() - t0 < 5
    assert fut.cancelled()


def test_a_probe_that_does_not_finish_is_cancelled_at_the_timeout(client, workers):
    fut = client.submit(time.sleep, 30, workers=[workers[0]], pure=False)
    with pytest.raises(ProbeLost, match="no answer within 1 s"):
        settle(client, [fut], [workers[0]], timeout=1)
    assert fut.cancelled()


def test_calibration_finishes_when_a_worker_is_killed_mid_way():
    with local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=":0") as cluster, Client(cluster) as c:
        rt = KVRuntime(c, "tiny-llama", block_size=16)
        victim = sorted(c.scheduler_info()["workers"])[1]
        out, errors = {}, []

        def run():
            try:
                out.update(rt.calibrate(probe_bytes="48MiB", probe_tokens=512))
            except Exception as e:  # noqa: BLE001 -- the test reports it
                errors.append(e)

        th = threading.Thread(target=run)
        th.start()
        time.sleep(1.0)
        with contextlib.suppress(Exception):  # the worker dies before it can answer
            c.run(os._exit, 1, workers=[victim])  # as SIGKILL: the nanny starts a new worker
        th.join(timeout=180)
        assert not th.is_alive(), "calibration is still waiting on the dead worker"
        assert not errors, errors
        assert out["prefill_profiles"], out  # the live workers were measured
        # the runtime stays usable afterwards
        s = rt.materialize(rt.encode("After the worker died, calibration ended and work goes on."))
        g = rt.resume(s, rt.encode(" Go."), max_new_tokens=4)
        assert len(g.tokens) == 4
        assert wait_for_restarts(cluster)  # the nanny's new worker is up: the cluster closes cleanly


def test_calibration_waits_for_every_probe_timing_not_just_the_first():
    """A profile exists once one timing arrived; the report waits until all have (or the
    plugin's window is full): bench JSONs kept one-sample rates, and the simulation fit them."""
    from daskflow_kv.runtime.calibration import probes_arrived

    w = ["tcp://a:1", "tcp://b:1"]
    assert not probes_arrived({w[0]: {"samples": 1}, w[1]: {"samples": 3}}, {}, w, 3)
    assert probes_arrived({w[0]: {"samples": 3}, w[1]: {"samples": 3}}, {}, w, 3)
    assert not probes_arrived({w[0]: {"samples": 5}}, {w[0]: 4}, w[:1], 3)  # 1 of 3 new ones so far
    assert probes_arrived({w[0]: {"samples": 64}}, {w[0]: 63}, w[:1], 3)  # the window (64) is full
    assert not probes_arrived({w[0]: {"samples": 3}}, {}, w, 3)  # b has reported nothing yet
