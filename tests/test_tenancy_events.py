"""Issue 51, item 5, and Dask's pages: what a client that never logged in reads about alice.

Lifecycle and prefill events went to Dask's event log with only their keys cut: any client
read namespace names, state ids, prompt lengths, cached-prefix lengths and prefill seconds -
the cached-prefix side channel, given away. With tenants configured nothing of them goes
there now: the lifecycle events stay in the plugin, shown per namespace behind a session
(``kv_counters``), and the workers' prefill timings come to the plugin alone (they still fit
the profiles and count per namespace). Dask's own ``/info`` pages that list full keys answer
403 (``daskflow-kv.dashboard.dask-key-pages``).

A real 2-worker cluster, tenants configured as in ``tests/test_tenancy.py``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from distributed import Client

from conftest import wait_until

from daskflow_kv.keys import EVENT_TOPIC, PREFILL_TOPIC, namespace_tag, short_key
from tenancy_kit import PROMPT, SUFFIX, cluster_fixture, plugin, tenant, text_tokens


cluster = cluster_fixture()
alice = tenant("alice")


def test_a_client_with_no_session_reads_nothing_of_alices_from_the_event_log(cluster, alice):
    heard = []
    with Client(cluster) as mallory:
        for topic in (EVENT_TOPIC, PREFILL_TOPIC):  # live, as they are published
            mallory.subscribe_topic(topic, heard.append)
        tokens = alice.encode(PROMPT)
        state = alice.materialize(tokens)
        again = alice.materialize(tokens + alice.encode(SUFFIX))  # reuses the first: a cached-prefix length
        gen = alice.resume(again, alice.encode(" Next:"), max_new_tokens=4)
        assert gen.tokens == text_tokens(alice, list(again.tokens) + alice.encode(" Next:"), 4)
        counters = plugin(cluster).catalog.counters_of
        assert wait_until(lambda: counters("alice").get("tokens_computed", 0) >= len(tokens))  # the workers' timings reached the plugin (its profiles and counters)
        assert plugin(cluster).profiles.prefill_profiles()
        logged = mallory.get_events()
        assert not logged.get(EVENT_TOPIC) and not logged.get(PREFILL_TOPIC) and not heard
        text = json.dumps({t: [m for _, m in evs] for t, evs in logged.items()}, default=str)
        for secret in ("alice", namespace_tag("alice"), state.state_id, again.state_id,
                       *map(short_key, again.state.block_keys)):
            assert secret not in text
    # behind her session, alice sees her own events, each state's tokens and reuse
    mine = [e for e in alice.counters()["events"] if e.get("state_id") == again.state_id and e["op"] == "materialize"]
    assert mine and mine[0]["namespace"] == "alice" and mine[0]["tokens_reused"] > 0


def test_dasks_pages_that_list_full_keys_are_off(cluster, alice):
    port = cluster.scheduler.http_server.port
    worker = next(iter(cluster.scheduler.workers))
    for page in (f"info/worker/{worker.replace('/', '%2F')}.html", "info/task/x.html", "info/main/exceptions.html",
                 f"info/call-stacks/{worker.replace('/', '%2F')}.html"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/{page}", timeout=10)
        assert e.value.code == 403 and b"dask-key-pages" in e.value.read()
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/kv/api.json", timeout=10).status == 200
    assert urllib.request.urlopen(f"http://127.0.0.1:{port}/info/main/workers.html", timeout=10).status == 200
