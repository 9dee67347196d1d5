"""Observability over HTTP on a real LocalCluster: the dashboard's KV page, its JSON and
Arrow endpoints, the KV metrics under the scheduler's /metrics, and the catalog export.

One cluster (2 worker processes) runs the RAG workflow in state mode, with a cost model
that prefers moving KV (slow prefill, fast links) so the run has transfers; then the KV
budget is lowered so cached blocks are evicted. The tests read what the page, the JSON and
/metrics show and check it against the scheduler plugin's own counters and against the
workflow's per-agent metrics.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from daskflow_kv.runtime.catalog_export import catalog_table, export_catalog, read_catalog
from daskflow_kv.runtime.catalog_export import main as catalog_main
from daskflow_kv.policy.cost_model import PrefillProfile
from daskflow_kv.plugins.dashboard import metrics as kv_metrics
from daskflow_kv.plugins.dashboard import KVDashboardPlugin
from daskflow_kv.plugins.dashboard.data import collect
from daskflow_kv.plugins.dashboard.render import render_page
from daskflow_kv.state.catalog import ARROW_COLUMNS
from daskflow_kv.runtime.cluster import embedded_runtime
from daskflow_kv.workflows import WORKFLOWS

COUNTER_NAMES = ("tokens_reused", "tokens_computed", "reuse_ratio", "bytes_transferred", "transfers", "recomputes",
                 "evictions", "bytes_evicted")


def _get(url: str, timeout: float = 15.0) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


def _settled(rt, until=lambda c: True, timeout: float = 20.0) -> dict:
    """The plugin's counters once they stop moving (worker timings arrive asynchronously)."""
    deadline = time.time() + timeout
    last, same = None, 0
    while time.time() < deadline:
        c = rt.counters()
        key = json.dumps([c["counters"], c["kv_bytes"]], sort_keys=True, default=str)
        same = same + 1 if key == last else 0
        last = key
        if same >= 3 and until(c):
            return c
        time.sleep(0.25)
    raise AssertionError(f"KV counters did not settle: {last}")


def _fetch_steady(rt, url: str, tries: int = 20) -> tuple[bytes, dict]:
    """GET ``url`` between two identical reads of the plugin's counters (eviction keeps
    working in the background as block leases expire): what the page showed and the truth."""
    for _ in range(tries):
        c1 = rt.counters()
        body = _get(url)[2]
        c2 = rt.counters()
        if json.dumps([c1["counters"], c1["kv_bytes"]], default=str) == json.dumps([c2["counters"], c2["kv_bytes"]],
                                                                                   default=str):
            return body, c2
        time.sleep(0.3)
    raise AssertionError("KV counters kept moving")


@pytest.fixture(scope="module")
def run():
    with embedded_runtime(n_workers=2, model="tiny-llama", block_size=16, dashboard_address="127.0.0.1:0") as rt:
        rt.client.register_plugin(KVDashboardPlugin())
        rt.prefill_override = PrefillProfile(0.0, 2e-3, 0.0)  # 500 tok/s: moving KV wins
        rt.bandwidth_override = 2e9
        wf = WORKFLOWS["rag"](tokenizer=rt.tokenizer, context_tokens=160, max_new_tokens=8, agents=3)
        result = wf.run(mode="state", runtime=rt)
        computed = sum(result.level_tokens_computed)
        before = _settled(rt, lambda c: c["counters"]["tokens_computed"] >= computed)
        budget = int(max(before["kv_bytes"].values()) * 0.7)
        rt.configure(kv_budget_bytes=budget)  # released states' cached blocks go under the budget
        after = _settled(rt, lambda c: c["counters"]["evictions"] > 0)
        base = f"http://127.0.0.1:{urllib.parse.urlsplit(rt.client.dashboard_link).port}"  # bound to loopback
        yield SimpleNamespace(rt=rt, result=result, before=before, after=after, budget=budget, base=base)


def _page_metrics(page: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for name, value in re.findall(r'data-metric="([a-z_]+)" data-value="([^"]+)"', page):
        out.setdefault(name, []).append(float(value))
    return out


def _prometheus(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def test_counters_match_the_workflows_own_metrics(run):
    """The plugin's counters (what the page shows) against the agents' metrics."""
    agents = run.result.agents.values()
    c = run.before["counters"]
    materialized = {}
    for events in run.result.lineage.values():
        for ev in events:
            if ev.get("op") == "materialize":
                materialized[ev["state_id"]] = ev.get("tokens_reused", 0)
    assert not [a.name for a in agents if a.decision == "recompute"], "the what-if cost model should never recompute"
    assert c["tokens_reused"] == sum(a.tokens_reused for a in agents) + sum(materialized.values())
    assert c["tokens_reused"] >= sum(a.tokens_reused for a in agents) > 0
    assert c["tokens_computed"] == sum(run.result.level_tokens_computed)
    assert c["bytes_transferred"] == sum(a.bytes_transferred for a in agents)
    assert c["transfers"] == sum(1 for a in agents if a.bytes_transferred)
    assert c["recomputes"] == 0
    total = c["tokens_reused"] + c["tokens_computed"]
    assert c["reuse_ratio"] == pytest.approx(c["tokens_reused"] / total)
    assert all(b > 0 for b in run.before["kv_bytes"].values()) and len(run.before["kv_bytes"]) == 2
    assert run.after["counters"]["evictions"] > 0 and run.after["counters"]["bytes_evicted"] > 0


def test_page_is_served_and_shows_the_plugins_numbers(run):
    status, ctype, _ = _get(run.base + "/kv")
    assert status == 200 and ctype.startswith("text/html")
    body, expected = _fetch_steady(run.rt, run.base + "/kv")
    page = body.decode()
    shown = _page_metrics(page)
    for name in set(COUNTER_NAMES) | set(expected["counters"]):  # the plugin's newer counters too
        assert shown[name] == [pytest.approx(expected["counters"][name])], name
    assert sorted(shown["worker_bytes"]) == sorted(float(b) for b in expected["kv_bytes"].values())
    for section in ("kv-cards", "kv-workers", "kv-lineage", "kv-states", "kv-decisions", "kv-events"):
        assert f'id="{section}"' in page
    assert "<svg" in page and "<script" in page and "http://" not in page.split("<script>")[1]  # no CDN
    for op in ("materialize", "fork", "resume", "evict"):
        assert f">{op}<" in page
    for name in COUNTER_NAMES:
        assert kv_metrics.metric_name(name) in page  # the page names its Prometheus series


def test_api_json_lists_states_blocks_workers_and_decisions(run):
    status, ctype, _ = _get(run.base + "/kv/api.json")
    assert status == 200 and ctype.startswith("application/json")
    body, expected = _fetch_steady(run.rt, run.base + "/kv/api.json")
    d = json.loads(body)
    assert d["available"] is True
    assert d["counters"] == pytest.approx(expected["counters"])
    assert d["kv_budget_bytes"] == run.budget == expected["kv_budget_bytes"]
    assert {w["address"]: w["kv_bytes"] for w in d["workers"]} == expected["kv_bytes"]
    assert all(w["kv_bytes"] > 0 and w["budget"] == run.budget for w in d["workers"])

    states = {s["state_id"]: s for s in d["states"]}
    workflow_states = {ev["state_id"] for events in run.result.lineage.values() for ev in events}
    assert workflow_states <= set(states)
    workers = set(expected["kv_bytes"])
    for sid in workflow_states:
        s = states[sid]
        assert s["worker"] in workers and s["status"] in ("live", "released")
        assert s["blocks"], sid
        ends = [b["end"] for b in s["blocks"]]
        assert ends == sorted(ends) and ends[-1] == s["tokens"]  # blocks cover [0, tokens) in order
        for b in s["blocks"]:
            assert 0 <= b["start"] < b["end"] and b["refcount"] >= 0 and b["status"]
    for name, agent in run.result.agents.items():
        final = run.result.lineage[name][-1]["state_id"]
        assert states[final]["worker"] == agent.worker
        assert states[final]["op"] == "resume"
    # the cost model's recent decisions, newest first, with their numbers
    plugin_decisions = list(reversed(expected["decisions"]))[: len(d["decisions"])]
    assert len(d["decisions"]) > 0
    for shown, real in zip(d["decisions"], plugin_decisions):
        for k in ("action", "src", "dst", "nbytes", "t_transfer", "t_recompute"):
            assert shown[k] == (pytest.approx(real[k]) if isinstance(real[k], float) else real[k])


def test_lineage_graph_and_focus(run):
    d = json.loads(_get(run.base + "/kv/api.json")[2])
    g = d["lineage"]
    states = {s["state_id"]: s for s in d["states"]}
    nodes = {n["id"]: n for n in g["nodes"]}
    ops = {n.get("op") for n in g["nodes"] if n["kind"] == "state"}
    assert {"materialize", "fork", "resume"} <= ops
    for e in g["edges"]:
        assert e["src"] in nodes and e["dst"] in nodes
        if e["kind"] != "evict":
            assert e["src"] in states[e["dst"]]["parents"]
            assert nodes[e["src"]]["x"] < nodes[e["dst"]]["x"]  # layered left to right
    assert any(n["kind"] == "evict" for n in g["nodes"])  # the budget evicted blocks
    assert (run.before["counters"]["transfers"] > 0) == any(e["kind"] == "transfer" for e in g["edges"])
    # one agent's lineage: its chain back to the materialize, nothing from the other family
    events = next(iter(run.result.lineage.values()))
    final = events[-1]["state_id"]
    focused = json.loads(_get(f"{run.base}/kv/api.json?state={final}")[2])["lineage"]
    ids = {n["id"] for n in focused["nodes"] if n["kind"] == "state"}
    assert {ev["state_id"] for ev in events} <= ids < set(nodes)
    page = _get(f"{run.base}/kv?state={final}")[2].decode()
    assert f"Lineage of <b class=\"mono\">{final}</b>" in page


def test_metrics_endpoint_has_the_kv_series(run):
    assert _get(run.base + "/metrics")[0] == 200
    body, c = _fetch_steady(run.rt, run.base + "/metrics")
    m = _prometheus(body.decode())
    for name in set(COUNTER_NAMES) | set(c["counters"]):
        assert m[(kv_metrics.metric_name(name), "")] == pytest.approx(c["counters"][name]), name
    assert kv_metrics.metric_name("tokens_reused") == "daskflow_kv_tokens_reused_total"
    for worker, nbytes in c["kv_bytes"].items():
        assert m[("daskflow_kv_worker_bytes", f'{{worker="{worker}"}}')] == nbytes > 0
    assert m[("daskflow_kv_worker_budget_bytes", "")] == run.budget
    live_released = sum(v for (k, _), v in m.items() if k == "daskflow_kv_states")
    assert live_released >= len({ev["state_id"] for evs in run.result.lineage.values() for ev in evs})
    assert any(k == "dask_scheduler_workers" for k, _ in m)  # Dask's own metrics are still served
    # Each worker's continuous-batching loop, from its own reports: the run's agents ran in it.
    steps = {w: m[("daskflow_kv_engine_mean_batch", f'{{worker="{w}"}}')] for w in c["kv_bytes"]}
    assert any(v >= 1.0 for v in steps.values()), steps
    assert all(("daskflow_kv_engine_step_seconds", f'{{worker="{w}"}}') in m for w in c["kv_bytes"])


def test_dashboard_index_links_the_page(run):
    try:
        paths = json.loads(_get(run.base + "/sitemap.json")[2])["paths"]
    except urllib.error.HTTPError:  # distributed 2026.8's sitemap fails on Bokeh's static routes
        paths = None
    if paths is not None:
        assert {"/kv/?", "/kv/api\\.json", "/kv/catalog\\.arrow", "/kv/catalog\\.parquet"} <= set(paths)
    pytest.importorskip("bokeh")
    status, _, body = _get(run.base + "/status")
    assert status == 200 and 'href="kv"' in body.decode()  # Dask's navigation bar has KV


def test_catalog_over_http_and_export_round_trip(run, tmp_path):
    names = [n for n, _ in ARROW_COLUMNS]
    expected = run.rt.catalog()
    assert expected.column_names == names and expected.num_rows > 0
    with pa.ipc.open_stream(_get(run.base + "/kv/catalog.arrow")[2]) as reader:
        over_http = reader.read_all()
    assert over_http.column_names == names and over_http.num_rows == expected.num_rows
    assert pq.read_table(pa.BufferReader(_get(run.base + "/kv/catalog.parquet")[2])).column_names == names

    address = run.rt.client.scheduler.address
    for source, fname, fmt in ((run.rt, "kv.parquet", None), (run.rt.client, "kv.arrow", None),
                               (address, "kv.arrows", None), (run.rt, "kv.bin", "arrow")):
        path = tmp_path / fname
        table = export_catalog(source, path, format=fmt)
        back = read_catalog(path, fmt)
        assert back.column_names == names and back.num_rows == table.num_rows == expected.num_rows
        assert sorted(back.column("block_key").to_pylist()) == sorted(expected.column("block_key").to_pylist())
    assert pa.ipc.open_file(pa.memory_map(str(tmp_path / "kv.arrow"))).read_all().num_rows == expected.num_rows
    assert catalog_main(["--scheduler", address, "--out", str(tmp_path / "cli.parquet")]) == 0
    assert pq.read_table(tmp_path / "cli.parquet").column_names == names
    assert catalog_table(run.rt.client).num_rows == expected.num_rows


def test_registering_again_is_idempotent(run):
    run.rt.client.register_plugin(KVDashboardPlugin())
    assert _get(run.base + "/kv")[0] == 200
    assert kv_metrics.installed_collector() is not None and len(kv_metrics.installed_collector()) >= 1


# -- without a cluster ----------------------------------------------------------------------
class _FakePlugin:
    """Only the operator views: the dashboard must not need more."""

    def __init__(self, reused):
        self.reused = reused

    def operator_counters(self):
        return {"counters": {"tokens_reused": self.reused, "tokens_computed": 10}, "kv_bytes": {"tcp://w:1": 5},
                "kv_budget_bytes": None, "decisions": [], "events": []}

    def operator_catalog(self):
        return [{"state_id": "kvstate-materialize-abc", "state_status": "live", "state_op": "materialize",
                 "state_parents": "", "block_key": "kvblock-1", "token_start": 0, "token_end": 16, "nbytes": 64,
                 "refcount": 1, "status": "memory", "workers": "tcp://w:1"}]


class _FakeScheduler:
    def __init__(self, plugin, address):
        self.plugins = {} if plugin is None else {"daskflow-kv": plugin}
        self.address = address
        self.workers = {}


_fake_scheduler = _FakeScheduler


def test_metrics_collectors_of_several_schedulers_do_not_clash():
    prometheus_client = pytest.importorskip("prometheus_client")
    a, b = _fake_scheduler(_FakePlugin(111), "tcp://a"), _fake_scheduler(_FakePlugin(222), "tcp://b")
    try:
        assert kv_metrics.install(a) and kv_metrics.install(a) and kv_metrics.install(b)
        m_a, m_b = _prometheus(kv_metrics.generate(a).decode()), _prometheus(kv_metrics.generate(b).decode())
        assert m_a[("daskflow_kv_tokens_reused_total", "")] == 111
        assert m_b[("daskflow_kv_tokens_reused_total", "")] == 222
        assert m_a[("daskflow_kv_reuse_ratio", "")] == pytest.approx(111 / 121)
        assert ("daskflow_kv_worker_budget_bytes", "") not in m_a  # unbounded: no budget series
    finally:
        kv_metrics.uninstall(a)
        kv_metrics.uninstall(b)
    collector = kv_metrics.installed_collector()
    if collector is None:  # the last scheduler gone: out of the registry
        assert b"daskflow_kv_" not in prometheus_client.generate_latest()


def test_page_renders_without_the_kv_plugin_and_with_a_minimal_one():
    d = collect(_fake_scheduler(None, "tcp://s"))
    assert d["available"] is False
    assert "not loaded" in render_page(d)
    d = collect(_fake_scheduler(_FakePlugin(5), "tcp://s"))
    page = render_page(d)
    assert d["available"] and d["states"][0]["blocks"][0]["end"] == 16
    assert _page_metrics(page)["tokens_reused"] == [5.0]
