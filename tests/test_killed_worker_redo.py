"""A level whose task Dask gave up on after its worker died (``KilledWorker``) is redone.

Dask fails a task once more than ``distributed.scheduler.allowed-failures`` workers died
while it was assigned to them, queued there or running. Played with the limit at 0 so one
death is enough: every KV task of the level queues behind a blocker on each worker, the
worker holding one is SIGKILLed (its nanny restarts it), and the workflow still ends with
the tokens of text mode, saying it redid a level.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import dask
from distributed import Client, Event

from daskflow_kv.flow.compiler import compile_workflow
from daskflow_kv.flow.executor import run_state_mode, run_text_mode
from daskflow_kv.flow.workflow import Workflow
from daskflow_kv.runtime.cluster import local_cluster, wait_for_restarts
from daskflow_kv.runtime.kv_runtime import KVRuntime

from conftest import CONTEXT, wait_until


def _block(name: str) -> bool:
    Event(name).wait()
    return True


def _kv_queued(client) -> dict[str, list]:
    return {w: [k for k in ks if str(k).startswith("kvprefill")] for w, ks in client.processing().items()}


def test_a_level_failed_by_a_dead_worker_is_redone_exactly():
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}), \
            local_cluster(n_workers=2, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        rt = KVRuntime(client, "tiny-llama", block_size=16)
        wf = Workflow("redo")
        wf.context("document", CONTEXT)
        wf.agent("a", "Summarize the document.", reads=["document"], max_new_tokens=6)
        wf.agent("b", "List its names.", reads=["document"], max_new_tokens=6)
        cw = compile_workflow(wf, rt.tokenizer, rt.facts.max_positions, rt.block_size)
        want = {n: a.tokens for n, a in run_text_mode(cw, rt).agents.items()}

        gate = Event("kv-redo-gate", client=client)
        workers = sorted(client.scheduler_info()["workers"])
        blockers = [client.submit(_block, "kv-redo-gate", workers=[w], pure=False, key=f"kv-redo-blocker-{i}")
                    for i, w in enumerate(workers)]
        assert wait_until(lambda: all(client.processing(workers=[w])[w] for w in workers), timeout=30)

        out: dict = {}

        def run():
            try:
                out["result"] = run_state_mode(compile_workflow(wf, rt.tokenizer, rt.facts.max_positions,
                                                                rt.block_size), rt)
            except Exception as e:  # noqa: BLE001 -- surfaced by the assertion below
                out["error"] = e

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        assert wait_until(lambda: any(_kv_queued(client).values()), timeout=60), "no KV task queued"
        victim = next(w for w, ks in _kv_queued(client).items() if ks)
        os.kill(client.run(os.getpid, workers=[victim])[victim], signal.SIGKILL)
        assert wait_until(lambda: victim not in client.scheduler_info()["workers"], timeout=30)
        time.sleep(0.5)
        gate.set()
        thread.join(120)
        assert not thread.is_alive(), "the workflow did not finish after its worker died"
        assert "error" not in out, out.get("error")
        result = out["result"]
        assert result.killed_worker_redos >= 1
        assert {n: a.tokens for n, a in result.agents.items()} == want
        del blockers
        wait_for_restarts(cluster)
