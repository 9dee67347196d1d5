"""A client lost mid-stream: its process is SIGKILLed while it holds live KV states.

A victim client process connects to the cluster, materializes contexts it keeps live
(pinned blocks, registered states, a session) and streams workflows; the surviving client
streams its own. The victim is SIGKILLed mid-stream. Then, from the scheduler itself: the
victim's client is gone, its sessions ended, every state it registered released, no key
wanted for it, and the blocks it pinned left to the cache (evictable) - and how long that
took. The survivor's workflows must all complete with text replay's tokens.

    python -m daskflow_kv.bench.client_lost --victim ADDRESS   # the victim's side (run by the scenario)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from .chaos import agent_tokens, run_flow
from .load_stream import Arrival, build, doc_sequence, documents


def _scheduler_view(client, victim: str) -> dict:
    """What the scheduler still holds of ``victim``: client, sessions, live states, wanted keys."""

    def look(dask_scheduler, victim):
        from daskflow_kv.keys import CACHE_CLIENT, PLUGIN_NAME

        plugin = dask_scheduler.plugins[PLUGIN_NAME]
        live = [st.state_id for st in plugin.catalog.states.values() if st.client == victim and st.status == "live"]
        cs = dask_scheduler.clients.get(victim)
        pinned = 0  # blocks the victim's states listed, still wanted by a client other than the cache
        for st in plugin.catalog.states.values():
            if st.client != victim:
                continue
            for k in st.block_keys:
                ts = dask_scheduler.tasks.get(k)
                if ts is not None and any(c.client_key not in (CACHE_CLIENT,) for c in ts.who_wants or ()):
                    pinned += 1
        return {"client_present": cs is not None, "wants": len(cs.wants_what) if cs is not None else 0,
                "sessions": plugin.tenants.sessions_of(victim),
                "live_states": len(live), "blocks_still_wanted": pinned,
                "registered_states": sum(1 for st in plugin.catalog.states.values() if st.client == victim)}

    return client.run_on_scheduler(look, victim=victim)


def run_client_lost(address: str, client, runtime, workflows: int = 12, kill_after: float = 4.0,
                    cleanup_s: float = 30.0, log=print) -> dict:
    """The scenario against the cluster at ``address`` (``client``/``runtime``: the survivor)."""
    victim = subprocess.Popen([sys.executable, "-m", "daskflow_kv.bench.client_lost", "--victim", address],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = victim.stdout.readline().strip()  # "ready <client id>" once its states are live
        if not line.startswith("ready "):
            raise RuntimeError(f"the victim client did not start: {line!r}")
        victim_id = line.split(" ", 1)[1]
        log(f"client-lost: victim {victim_id} holds live states; survivor streams {workflows} workflows")
        before = _scheduler_view(client, victim_id)
        texts = documents(runtime.tokenizer, 2, 128)
        docs = doc_sequence(workflows, 2, "zipf", seed=3)
        flows = [build(Arrival(i, 0.0, 0, docs[i]), texts[docs[i]], "survivor", 6) for i in range(workflows)]
        ref = [agent_tokens(run_flow(runtime, wf, "text")) for wf in flows]
        results: list = [None] * workflows

        def stream():
            for i, wf in enumerate(flows):
                try:
                    results[i] = agent_tokens(run_flow(runtime, wf, "state")) == ref[i]
                except Exception as e:  # noqa: BLE001 -- recorded
                    results[i] = f"{type(e).__name__}: {e}"

        th = threading.Thread(target=stream, daemon=True)
        th.start()
        time.sleep(kill_after)
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.time()
        log("client-lost: victim SIGKILLed")
        cleaned_s, after = None, None
        while time.time() - killed_at < cleanup_s:
            after = _scheduler_view(client, victim_id)
            if not after["client_present"] and not after["sessions"] and not after["live_states"] \
                    and not after["blocks_still_wanted"]:
                cleaned_s = time.time() - killed_at
                break
            time.sleep(0.2)
        th.join(timeout=600)
    finally:
        if victim.poll() is None:
            victim.kill()
    ok = [r for r in results if r is True]
    return {"victim_before": before, "victim_after": after, "cleaned_within_s": cleaned_s,
            "survivor_workflows": workflows, "survivor_completed": sum(1 for r in results if r in (True, False)),
            "survivor_agree": len(ok), "survivor_errors": [r for r in results if isinstance(r, str)][:5],
            "kill_after_s": kill_after}


def _victim(address: str) -> None:
    """The victim's side: live states, a session, then workflows until it is killed."""
    from distributed import Client

    from ..runtime.kv_runtime import KVRuntime

    client = Client(address)
    rt = KVRuntime(client, "tiny-llama", block_size=16)
    texts = documents(rt.tokenizer, 2, 128)
    held = [rt.materialize(rt.encode(t)) for t in texts]  # kept live: pinned until the process dies
    rt.wait(held)
    print(f"ready {client.id}", flush=True)
    i = 0
    while True:
        wf = build(Arrival(1000 + i, 0.0, 1, i % 2), texts[i % 2], "victim", 6)
        run_flow(rt, wf, "state")
        i += 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--victim":
        _victim(sys.argv[2])
    else:
        sys.exit("usage: python -m daskflow_kv.bench.client_lost --victim SCHEDULER_ADDRESS")
