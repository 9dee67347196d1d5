"""The KV page's templates, rendered from a scheduler stand-in (no cluster, no model):
escaping of user data, the page with an empty catalog, the refresh interval from config,
and the refresh JSON's sections being the page's own."""

from __future__ import annotations

import re
from pathlib import Path

import dask
import pytest

from daskflow_kv.plugins.dashboard import render as kv_dashboard_render, view as kv_dashboard_view
from daskflow_kv.plugins.dashboard.data import collect
from daskflow_kv.plugins.dashboard.render import render_page, render_sections

EVIL = '<script>alert("kv")</script>'
SECTION_IDS = ("kv-cards", "kv-workers", "kv-lineage", "kv-states", "kv-decisions", "kv-events")


class _Plugin:
    """The KV scheduler plugin's RPC handlers, serving ``rows`` and a few counters."""

    def __init__(self, rows=(), events=()):
        self.rows, self.events = list(rows), list(events)

    def operator_counters(self):
        return {"counters": {"tokens_reused": 0, "tokens_computed": 0}, "kv_bytes": {"tcp://w:1": 0},
                "kv_budget_bytes": None, "decisions": [], "events": []}

    def operator_catalog(self):
        return self.rows


class _Worker:
    def __init__(self, name):
        self.name = name


class _Scheduler:
    def __init__(self, plugin, workers=None):
        self.plugins = {} if plugin is None else {"daskflow-kv": plugin}
        self.address = "tcp://scheduler:8786"
        self.workers = {addr: _Worker(name) for addr, name in (workers or {}).items()}


def _row(state_id, worker="tcp://w:1", **kw):
    return dict({"state_id": state_id, "state_status": "live", "state_op": "materialize", "state_parents": "",
                 "block_key": f"kvblock-{len(state_id)}", "token_start": 0, "token_end": 16, "nbytes": 64,
                 "refcount": 1, "status": "memory", "workers": worker}, **kw)


def _escaped_state_page():
    sid = f"kvstate-materialize-{EVIL}"
    plugin = _Plugin([_row(sid)], events=[{"op": "materialize", "time": 1.0, "state_id": sid, "worker": "tcp://w:1",
                                           "tokens": 16, "blocks": 1, "detail": EVIL}])
    return collect(_Scheduler(plugin, {"tcp://w:1": f"<b>{EVIL}</b>"}))


def test_user_data_is_escaped():
    d = _escaped_state_page()
    assert d["states"][0]["state_id"].endswith(EVIL)
    page = render_page(d, nav=[("status", "Status")])
    assert page.count("<script") == 1  # the page's own script only
    assert "<b><script>" not in page and 'alert("kv")' not in page
    assert "&lt;script&gt;alert(&#34;kv&#34;)&lt;/script&gt;" in page
    assert 'title="kvstate-materialize-&lt;script&gt;' in page  # in attributes too
    assert "&lt;b&gt;&lt;script&gt;" in page  # the worker's name
    for html in render_sections(d).values():  # what the page's script puts into innerHTML
        assert "<script" not in html and "<b><" not in html


def test_empty_catalog_page():
    d = collect(_Scheduler(_Plugin()))
    assert d["available"] and d["states"] == [] and d["lineage"]["nodes"] == []
    page = render_page(d)
    for section in SECTION_IDS:
        assert f'id="{section}"' in page
    for text in ("No states yet: run a workflow", "No states in the catalog.", "No cost-model decisions yet.",
                 "No lifecycle events yet.", "no per-worker budget set"):
        assert text in page, text
    assert "<svg" not in page and "not loaded" not in page
    shown = {k: float(v) for k, v in re.findall(r'data-metric="([a-z_]+)" data-value="([^"]+)"', page)}
    assert shown["tokens_reused"] == shown["tokens_computed"] == shown["worker_bytes"] == 0


def test_page_without_the_kv_plugin_has_no_sections():
    d = collect(_Scheduler(None))
    page = render_page(d)
    assert "not loaded" in page and not any(f'id="{s}"' in page for s in SECTION_IDS)
    assert render_sections(d) == {name: "" for name in kv_dashboard_view.SECTIONS}


def test_refresh_interval_comes_from_config():
    d = collect(_Scheduler(_Plugin()))
    page = render_page(d)
    assert 'data-refresh="2000"' in page and "every 2 s" in page  # daskflow-kv.yaml: 2s
    with dask.config.set({"daskflow-kv.dashboard.refresh": "500ms"}):
        page = render_page(d)
    assert 'data-refresh="500"' in page and "every 0.5 s" in page
    assert "setInterval(tick, every)" in page


def test_sections_refreshed_by_the_script_are_the_pages_own():
    d = collect(_Scheduler(_Plugin([_row("kvstate-materialize-abc")])), "kvstate-materialize-abc")
    page = render_page(d)
    sections = render_sections(d)
    assert set(sections) == {s.removeprefix("kv-") for s in SECTION_IDS}
    for name, html in sections.items():
        assert html and html in page, name
    assert 'Lineage of <b class="mono">kvstate-materialize-abc</b>' in sections["lineage"]
    assert 'class="node-link"' in sections["lineage"] and 'aria-expanded="true"' in sections["states"]


def test_templates_are_package_data():
    folder = Path(kv_dashboard_render.__file__).with_name("templates")
    # pyproject ships templates/*.html, *.js and *.css, nothing in subfolders
    assert all(p.is_file() and p.suffix in (".html", ".js", ".css") for p in folder.iterdir())
    for name in ["kv.html", "kv.css", "kv.js"] + [f"kv_{s}.html" for s in kv_dashboard_view.SECTIONS]:
        assert (folder / name).is_file(), name
    assert kv_dashboard_render.environment().autoescape is True


@pytest.mark.parametrize("value, shown", [(None, "–"), (float("inf"), "∞"), (0.0123, "12.3 ms"), (2.5, "2.50 s")])
def test_durations_filter(value, shown):
    env = kv_dashboard_render.environment()
    assert env.from_string("{{ t|seconds }}").render(t=value) == shown


def test_blocks_show_their_tier_and_the_store_card_its_counters():
    rows = [_row("kvstate-materialize-t1", block_key="kvblock-a", tier="memory", persisted=True),
            _row("kvstate-materialize-t1", block_key="kvblock-b", token_start=16, token_end=32, tier="spilled"),
            _row("kvstate-materialize-t1", block_key="kvblock-c", token_start=32, token_end=48, tier="store",
                 persisted=True, status="evicted", workers="")]
    d = collect(_Scheduler(_Plugin(rows)))
    assert d["block_tiers"] == {"memory": 1, "spilled": 1, "store": 1}
    [state] = d["states"]
    assert [b["tier"] for b in state["blocks"]] == ["memory", "spilled", "store"]
    assert state["block_tiers"] == {"memory": 1, "spilled": 1, "store": 1}
    html = render_sections(d)
    states = html["kv-states"] if "kv-states" in html else html["states"]
    for text in (">memory +store<", ">spilled<", ">store<", ">spilled 1<", ">store 1<"):
        assert text in states, text
    cards = html["kv-cards"] if "kv-cards" in html else html["cards"]
    assert "Persistent store" in cards and 'data-metric="store_loads"' in cards
