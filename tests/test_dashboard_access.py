"""Who sees what on the KV pages, without a cluster: the views of an anonymous browser, a
tenant and an admin built from a scheduler stand-in holding a real tenant registry; the
login cookie (forged, tampered, expired, revoked); login challenges (single use, expiring,
bounded); the browser's proof against ``tenants.login_proof``; namespaces in /metrics.

``tests/test_dashboard_tenancy.py`` plays the same over HTTP on a real cluster.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import dask
import pyarrow as pa
import pytest

from daskflow_kv.keys import short_key
from daskflow_kv.plugins.dashboard import access, metrics as kv_metrics, render as kv_dashboard_render
from daskflow_kv.plugins.dashboard.data import collect
from daskflow_kv.plugins.dashboard.plugin import catalog_table
from daskflow_kv.plugins.dashboard.render import render_page, render_sections
from daskflow_kv.plugins.dashboard.session import Challenges, SessionCookies
from daskflow_kv.plugins.tenants import TenantRegistry, login_proof

TENANTS = {"alice": {"secret": "alice-s3cret", "role": "user"}, "bob": {"secret": "bob-s3cret", "role": "user"},
           "ops": {"secret": "ops-s3cret", "role": "admin"}}
KEYS = {ns: f"kvblock-{ns[0] * 8}{'0123456789abcdef' * 3}" for ns in ("alice", "bob")}  # full block keys
STATES = {"alice": "kvstate-materialize-a11ce0000001", "bob": "kvstate-materialize-b0b000000002"}


class _Plugin:
    """The KV scheduler plugin's public views over two tenants' rows, events and decisions."""

    def __init__(self, tenants=TENANTS):
        self.tenants = TenantRegistry(tenants)

    def operator_catalog(self):
        return [{"namespace": ns, "state_id": STATES[ns], "state_status": "live", "state_op": "materialize",
                 "state_parents": "", "block_key": KEYS[ns], "parent_key": "", "token_start": 0, "token_end": 16,
                 "nbytes": 64, "refcount": 1, "status": "memory", "workers": "tcp://w:1", "lineage_state": STATES[ns]}
                for ns in ("alice", "bob")]

    def operator_events(self):
        return [{"op": "materialize", "time": 1.0 + i, "namespace": ns, "state_id": STATES[ns], "worker": "tcp://w:1",
                 "tokens": 16 + i, "blocks": 1, "key": KEYS[ns]} for i, ns in enumerate(("alice", "bob"))]

    def operator_counters(self):
        return {"counters": {"tokens_reused": 3, "tokens_computed": 32}, "kv_bytes": {"tcp://w:1": 128},
                "kv_budget_bytes": 1000, "events": [],
                "decisions": [{"action": "transfer", "namespace": ns, "src": "tcp://w:1", "dst": "tcp://w:2",
                               "nbytes": 64, "t_transfer": 0.1, "t_recompute": 0.2, "reason": f"for {ns}"}
                              for ns in ("alice", "bob")]}


class _Scheduler:
    def __init__(self, plugin):
        self.plugins = {"daskflow-kv": plugin}
        self.address = "tcp://scheduler:8786"
        self.workers = {}


def _private(ns: str) -> list[str]:
    """What only ``ns`` (and the admin) may see: its name, state id, keys full and cut."""
    return [ns, STATES[ns], STATES[ns].rsplit("-", 1)[1][:6], KEYS[ns], short_key(KEYS[ns]), KEYS[ns][8:16]]


def _everything(d: dict) -> str:
    return json.dumps(d) + "".join(render_sections(d).values()) + render_page(d)


def _viewer(plugin, ns):
    return access.viewer(plugin, SessionCookies().issue(ns, TENANTS[ns]["role"], 60)[1])


def test_anonymous_sees_totals_only():
    plugin = _Plugin()
    d = collect(_Scheduler(plugin), focus=STATES["alice"])  # no session: anonymous
    assert d["viewer"] == {"role": "anonymous", "namespace": None, "tenants": True, "detail": False}
    assert not {"states", "lineage", "decisions", "events"} & set(d) and d["focus"] is None
    assert d["counters"]["tokens_computed"] == 32 and d["workers"][0]["kv_bytes"] == 128
    assert d["state_status"] == {"live": 2} and d["block_status"] == {"memory": 2}
    assert d["workers"][0]["blocks"] == d["workers"][0]["live_states"] == 2  # counted over every namespace
    text = _everything(d)
    for ns in ("alice", "bob"):
        for secret in _private(ns):
            assert secret not in text, secret
    assert "totals only" in text and "kv/login" in text and "2 states" in text
    table = catalog_table(_Scheduler(plugin))
    assert table.column_names == ["status", "tier", "blocks", "nbytes"]
    assert table.to_pylist() == [{"status": "memory", "tier": "", "blocks": 2, "nbytes": 128}]


def test_a_tenant_sees_its_own_namespace_and_an_admin_all():
    plugin = _Plugin()
    alice = collect(_Scheduler(plugin), viewer=_viewer(plugin, "alice"))
    assert [s["state_id"] for s in alice["states"]] == [STATES["alice"]]
    assert [e["state_id"] for e in alice["events"]] == [STATES["alice"]]
    assert [x["reason"] for x in alice["decisions"]] == ["for alice"]
    assert alice["states"][0]["blocks"][0]["key"] == short_key(KEYS["alice"])  # cut short
    text = _everything(alice)
    assert STATES["alice"] in text and "logged in as <b>alice</b>" in text
    for secret in _private("bob") + [KEYS["alice"]]:
        assert secret not in text, secret
    assert alice["block_status"] == {"memory": 2}  # totals are still everyone's
    table = catalog_table(_Scheduler(plugin), _viewer(plugin, "alice"))
    assert table.column("namespace").to_pylist() == ["alice"]
    assert table.column("block_key").to_pylist() == [short_key(KEYS["alice"])]

    ops = collect(_Scheduler(plugin), viewer=_viewer(plugin, "ops"))
    assert {s["state_id"] for s in ops["states"]} == set(STATES.values())
    assert {s["namespace"] for s in ops["states"]} == {"alice", "bob"}
    assert len(ops["events"]) == len(ops["decisions"]) == 2
    assert KEYS["alice"] not in _everything(ops)  # the admin's keys are cut short too
    assert catalog_table(_Scheduler(plugin), _viewer(plugin, "ops")).num_rows == 2


def test_without_tenants_everyone_sees_everything():
    plugin = _Plugin(tenants={})
    d = collect(_Scheduler(plugin))
    assert d["viewer"]["role"] == "admin" and not d["viewer"]["tenants"]
    assert {s["state_id"] for s in d["states"]} == set(STATES.values())
    assert {b["key"] for s in d["states"] for b in s["blocks"]} == set(KEYS.values())  # one trust domain: full keys
    assert "log in" not in render_page(d)


# -- the login cookie ---------------------------------------------------------------------------
def test_cookie_round_trip_and_every_way_it_is_refused():
    cookies = SessionCookies()
    value, s = cookies.issue("alice", "user", ttl=60, now=1000.0)
    assert cookies.read(value, now=1030.0) == s and (s.namespace, s.role, s.expires) == ("alice", "user", 1060.0)
    payload, mac = value.split(".")
    forged_payload = payload[:-2] + ("A" if payload[-2] != "A" else "B") + payload[-1]
    admin, _ = SessionCookies().issue("alice", "admin", ttl=60, now=1000.0)  # another process's key
    for bad in (None, "", "garbage", payload, f"{forged_payload}.{mac}", f"{payload}.{mac[:-1]}x", admin,
                f"{admin.split('.')[0]}.{mac}"):
        assert cookies.read(bad, now=1030.0) is None, bad
    assert cookies.read(value, now=1060.0) is None  # expired
    cookies.revoke(s, now=1030.0)
    assert cookies.read(value, now=1031.0) is None  # logged out
    cookies.revoke(cookies.issue("bob", "user", ttl=60, now=1100.0)[1], now=1100.0)  # revocations expire too
    assert s.sid not in cookies._revoked


# -- challenges -----------------------------------------------------------------------------------
def test_challenges_are_single_use_expiring_and_bounded():
    registry = TenantRegistry(TENANTS)
    ch = Challenges(registry, limit=3, ttl=60)
    nonce = ch.issue()
    assert ch.verify("alice", nonce, login_proof("alice-s3cret", nonce, "alice")) == ("alice", "user")
    assert ch.verify("alice", nonce, login_proof("alice-s3cret", nonce, "alice")) is None  # replayed
    assert len(registry) == 0  # the registry's session for the check ended at once
    nonce = ch.issue()
    assert ch.verify("alice", nonce, login_proof("bob-s3cret", nonce, "alice")) is None  # wrong secret
    assert ch.verify("alice", nonce, login_proof("alice-s3cret", nonce, "alice")) is None  # a refusal uses it up
    nonce = ch.issue()
    assert ch.verify("ops", nonce, login_proof("ops-s3cret", nonce, "ops")) == ("ops", "admin")
    foreign = registry.challenge()  # a client's nonce: not one this table issued
    assert ch.verify("alice", foreign, login_proof("alice-s3cret", foreign, "alice")) is None
    held = [ch.issue(now=100.0) for _ in range(3)]
    assert None not in held and ch.issue(now=101.0) is None and len(ch) == 3  # bounded
    assert not ch.take(held[0], now=200.0)  # expired
    assert ch.issue(now=200.0) is not None  # expired ones make room


def test_browser_proof_is_login_proof():
    """kv_login.js's HMAC, run under node's WebCrypto, equals tenants.login_proof."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    js = (Path(kv_dashboard_render.__file__).with_name("templates") / "kv_login.js").read_text()
    script = js + "\nkvLoginProof('s3cret é', 'alice', 'abc123').then(function(p){ console.log(p); });"
    out = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == login_proof("s3cret é", "abc123", "alice")


def test_login_page_never_posts_the_secret():
    page = kv_dashboard_render.render_login({
        "prefix": "/", "nav": [("status", "Status")], "available": True, "tenants": True, "nonce": "n0nce",
        "message": "", "ttl_s": 3600.0, "challenge_ttl_s": 60.0, "session": None})
    secret_input = page[page.index('id="secret"') - 40: page.index('id="secret"') + 80]
    assert "name=" not in secret_input  # a field without a name is never submitted
    for field in ('name="namespace"', 'name="nonce" value="n0nce"', 'name="proof"'):
        assert field in page
    assert "--nonce n0nce" in page and page.count("<script") == 1


# -- namespaces in /metrics ---------------------------------------------------------------------------
def test_metrics_name_namespaces_only_when_enabled():
    pytest.importorskip("prometheus_client")
    scheduler = _Scheduler(_Plugin())
    try:
        kv_metrics.install(scheduler)
        off = kv_metrics.generate(scheduler).decode()
        with dask.config.set({"daskflow-kv.dashboard.tenant-labels": True}):
            on = kv_metrics.generate(scheduler).decode()
    finally:
        kv_metrics.uninstall(scheduler)
    kv_off = [line for line in off.splitlines() if line.startswith("daskflow_kv_")]
    assert kv_off and not [line for line in kv_off if "namespace" in line or "alice" in line or "bob" in line]
    assert 'daskflow_kv_tenant_states{namespace="alice",status="live"} 1.0' in on
    assert 'daskflow_kv_tenant_blocks{namespace="bob",status="memory"} 1.0' in on
    assert 'daskflow_kv_tenant_bytes{namespace="alice"} 64.0' in on
    assert 'daskflow_kv_states{status="live"} 2.0' in on  # the totals are unchanged


def test_totals_table_counts_each_block_once():
    rows = [{"block_key": "kvblock-1", "status": "memory", "tier": "memory", "nbytes": 10},
            {"block_key": "kvblock-1", "status": "memory", "tier": "memory", "nbytes": 10},  # a second state
            {"block_key": "kvblock-2", "status": "evicted", "tier": "store", "nbytes": 5}]
    t = access.totals_table(rows)
    assert isinstance(t, pa.Table) and t.to_pylist() == [
        {"status": "evicted", "tier": "store", "blocks": 1, "nbytes": 5},
        {"status": "memory", "tier": "memory", "blocks": 1, "nbytes": 10}]
