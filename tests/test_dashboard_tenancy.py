"""The KV pages of a scheduler with tenants, over real HTTP: who sees what.

A real 2-worker LocalCluster with three tenants (two users, one admin). Each user runs a
small workflow (materialize a prompt, fork it twice, resume both forks). Then a browser is
played with plain HTTP requests: anonymous, it gets totals only on every KV route; logged
in through ``/kv/login`` (the challenge answered with ``tenants.login_proof``), it sees its
own namespace and not the other's; the admin sees both; a tampered, forged, expired or
logged-out cookie is anonymous; a replayed challenge is refused; ``/metrics`` names no
namespace unless the operator enables it.
"""

from __future__ import annotations

import http.client
import io
import json
import re
import time
import urllib.parse

import dask
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from distributed import Client

from daskflow_kv.keys import short_key
from daskflow_kv.plugins.dashboard.session import COOKIE, SessionCookies
from daskflow_kv.plugins.tenants import login_proof
from daskflow_kv.runtime.cluster import local_cluster
from daskflow_kv.runtime.kv_runtime import KVRuntime

# Names that cannot occur by chance in a page, a table or /metrics.
TENANTS = {
    "alice-lab": {"secret": "alice-secret-5e1f", "role": "user"},
    "bob-lab": {"secret": "bob-secret-9c0d", "role": "user"},
    "ops-team": {"secret": "ops-secret-2b7a", "role": "admin"},
}
USERS = ("alice-lab", "bob-lab")
PROMPTS = {"alice-lab": "Quarterly numbers of the alice lab: revenue up, costs flat, two hires planned.",
           "bob-lab": "Bob lab notebook: the second assay failed again; reorder the reagent and retry Monday."}
ROUTES = ("/kv", "/kv/api.json", "/kv/api.json?html=1", "/kv/catalog.arrow", "/kv/catalog.parquet")


def _request(base: str, method: str, path: str, cookie: str | None = None, form: dict | None = None,
             headers: dict | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request, redirects not followed (a login answers 303 with its cookie)."""
    u = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=15)
    h = dict(headers or {})
    if cookie is not None:
        h["Cookie"] = f"{COOKIE}={cookie}"
    body = None
    if form is not None:
        body = urllib.parse.urlencode(form)
        h["Content-Type"] = "application/x-www-form-urlencoded"
    try:
        conn.request(method, path, body=body, headers=h)
        r = conn.getresponse()
        return r.status, r.headers, r.read()
    finally:
        conn.close()


def _nonce(base: str) -> str:
    status, _, body = _request(base, "GET", "/kv/login")
    assert status == 200, body
    return re.search(r'name="nonce" value="([0-9a-f]+)"', body.decode()).group(1)


def _post_login(base: str, namespace: str, nonce: str, secret: str | None = None, headers=None):
    proof = login_proof(TENANTS[namespace]["secret"] if secret is None else secret, nonce, namespace)
    return _request(base, "POST", "/kv/login", form={"namespace": namespace, "nonce": nonce, "proof": proof},
                    headers=headers)


def _cookie(headers: http.client.HTTPMessage) -> str | None:
    for v in headers.get_all("Set-Cookie") or ():
        if v.startswith(COOKIE + "="):
            return v.split(";", 1)[0].split("=", 1)[1]
    return None


def _login(base: str, namespace: str) -> str:
    status, headers, _ = _post_login(base, namespace, _nonce(base))
    assert status == 303 and headers["Location"] == "/kv"
    return _cookie(headers)


def _text(path: str, body: bytes) -> str:
    """What a response says, tables included (Arrow/Parquet read back as their rows)."""
    if path.endswith(".arrow"):
        with pa.ipc.open_stream(body) as reader:
            return json.dumps(reader.read_all().to_pylist(), default=str) + body.decode("latin-1")
    if path.endswith(".parquet"):
        return json.dumps(pq.read_table(io.BytesIO(body)).to_pylist(), default=str) + body.decode("latin-1")
    return body.decode()


@pytest.fixture(scope="module")
def run():
    with dask.config.set({"daskflow-kv.tenants": TENANTS}):
        with local_cluster(n_workers=2, dashboard_address="127.0.0.1:0") as cluster:
            runtimes, private = [], {}
            try:
                for ns in USERS:
                    rt = KVRuntime(Client(cluster), "tiny-llama", block_size=16, namespace=ns,
                                   secret=TENANTS[ns]["secret"])
                    runtimes.append(rt)
                    root = rt.materialize(rt.encode(PROMPTS[ns]))
                    forks = rt.fork(root, 2)
                    gens = rt.resume_many([(f, rt.encode(f" question {i}")) for i, f in enumerate(forks)],
                                          max_new_tokens=2)
                    states = [root, *forks, *(g.state for g in gens if g.state is not None)]
                    keys = {k for s in states for k in s.state.block_keys}
                    private[ns] = {"states": {s.state_id for s in states}, "keys": keys}
                base = f"http://127.0.0.1:{cluster.scheduler.http_server.port}"
                yield type("Run", (), {"base": base, "private": private, "cluster": cluster, "runtimes": runtimes})
            finally:
                for rt in runtimes:
                    rt.client.close()


def _secrets_of(run, ns: str) -> list[str]:
    """What only ``ns`` and the admin may see: its name, state ids (and their id tails), keys full and cut."""
    p = run.private[ns]
    return ([ns] + sorted(p["states"]) + [s.rsplit("-", 1)[1] for s in p["states"]]
            + sorted(p["keys"]) + [short_key(k) for k in p["keys"]])


def test_anonymous_gets_totals_only_on_every_route(run):
    some_state = sorted(run.private["alice-lab"]["states"])[0]
    for path in ROUTES + (f"/kv?state={some_state}", f"/kv/api.json?state={some_state}", "/metrics"):
        status, headers, body = _request(run.base, "GET", path)
        assert status == 200, path
        assert headers["Cache-Control"] == "no-store" or path == "/metrics"
        text = _text(path, body)
        for ns in USERS:
            for secret in _secrets_of(run, ns):
                assert secret not in text, (path, secret)
        assert "ops-team" not in text, path
        if path == "/metrics":  # Dask's own series name task prefixes ("kvprefill-materialize-kvstate-...")
            text = "\n".join(line for line in text.splitlines() if line.startswith("daskflow_kv_"))
        assert "kvstate-" not in text and "kvblock-" not in text, path
    d = json.loads(_request(run.base, "GET", "/kv/api.json")[2])
    assert d["viewer"]["role"] == "anonymous"
    assert not {"states", "lineage", "decisions", "events"} & set(d)
    n_states = sum(len(p["states"]) for p in run.private.values())
    assert sum(d["state_status"].values()) >= n_states  # every state counted, none named
    assert d["counters"]["tokens_computed"] > 0 and sum(w["kv_bytes"] for w in d["workers"]) > 0
    with pa.ipc.open_stream(_request(run.base, "GET", "/kv/catalog.arrow")[2]) as reader:
        totals = reader.read_all()
    assert totals.column_names == ["status", "tier", "blocks", "nbytes"]
    assert sum(totals.column("blocks").to_pylist()) >= len(set().union(*(p["keys"] for p in run.private.values())))


def test_a_tenant_sees_its_own_namespace_and_not_the_others(run):
    cookie = _login(run.base, "alice-lab")
    d = json.loads(_request(run.base, "GET", "/kv/api.json", cookie)[2])
    assert d["viewer"] == {"role": "user", "namespace": "alice-lab", "tenants": True, "detail": True}
    shown = {s["state_id"] for s in d["states"]}
    assert run.private["alice-lab"]["states"] <= shown
    assert {s["namespace"] for s in d["states"]} == {"alice-lab"}
    keys = {b["key"] for s in d["states"] for b in s["blocks"]}
    assert {short_key(k) for k in run.private["alice-lab"]["keys"]} <= keys  # cut short
    assert d["events"] and {e.get("namespace") for e in d["events"]} == {"alice-lab"}
    for path in ROUTES:
        text = _text(path, _request(run.base, "GET", path, cookie)[2])
        for secret in _secrets_of(run, "bob-lab") + sorted(run.private["alice-lab"]["keys"]):
            assert secret not in text, (path, secret)
    page = _request(run.base, "GET", "/kv", cookie)[2].decode()
    assert "logged in as <b>alice-lab</b>" in page and sorted(shown)[0] in page
    with pa.ipc.open_stream(_request(run.base, "GET", "/kv/catalog.arrow", cookie)[2]) as reader:
        table = reader.read_all()
    assert set(table.column("namespace").to_pylist()) == {"alice-lab"}
    assert {short_key(k) for k in run.private["alice-lab"]["keys"]} <= set(table.column("block_key").to_pylist())
    parquet = pq.read_table(io.BytesIO(_request(run.base, "GET", "/kv/catalog.parquet", cookie)[2]))
    assert set(parquet.column("namespace").to_pylist()) == {"alice-lab"}


def test_the_admin_sees_every_namespace(run):
    cookie = _login(run.base, "ops-team")
    d = json.loads(_request(run.base, "GET", "/kv/api.json", cookie)[2])
    assert d["viewer"]["role"] == "admin"
    shown = {s["state_id"] for s in d["states"]}
    for ns in USERS:
        assert run.private[ns]["states"] <= shown
    assert {"alice-lab", "bob-lab"} <= {s["namespace"] for s in d["states"]}
    with pa.ipc.open_stream(_request(run.base, "GET", "/kv/catalog.arrow", cookie)[2]) as reader:
        assert {"alice-lab", "bob-lab"} <= set(reader.read_all().column("namespace").to_pylist())
    text = _request(run.base, "GET", "/kv/api.json", cookie)[2].decode()
    for ns in USERS:  # even the admin's page holds no usable key
        assert not [k for k in run.private[ns]["keys"] if k in text]


def test_the_cookie_is_http_only_strict_and_scoped(run):
    status, headers, _ = _post_login(run.base, "bob-lab", _nonce(run.base))
    assert status == 303
    [set_cookie] = [v for v in headers.get_all("Set-Cookie") if v.startswith(COOKIE + "=")]
    attrs = {a.strip().split("=")[0].lower(): a.strip() for a in set_cookie.split(";")[1:]}
    assert {"httponly", "samesite", "path", "max-age"} <= set(attrs)
    assert attrs["samesite"] == "SameSite=Strict" and attrs["path"] == "Path=/kv"
    assert attrs["max-age"] == "Max-Age=3600"  # daskflow-kv.dashboard.session-ttl: 1h
    assert headers["Vary"] == "Cookie" and headers["Cache-Control"] == "no-store"


def test_tampered_forged_expired_and_logged_out_cookies_are_anonymous(run):
    good = _login(run.base, "alice-lab")
    payload, mac = good.split(".")
    flipped = payload[:5] + ("A" if payload[5] != "A" else "B") + payload[6:]
    forged, _ = SessionCookies().issue("alice-lab", "admin", ttl=600)  # signed with a key the scheduler never had
    with dask.config.set({"daskflow-kv.dashboard.session-ttl": "1s"}):
        short_lived = _login(run.base, "alice-lab")
    assert _role(run, short_lived) == "user"
    time.sleep(1.2)
    for bad in (f"{flipped}.{mac}", f"{payload}.{mac[::-1]}", forged, short_lived, "not-a-cookie"):
        assert _role(run, bad) == "anonymous", bad
        assert "alice-lab" not in _request(run.base, "GET", "/kv", bad)[2].decode()
    assert _role(run, good) == "user"
    status, headers, _ = _request(run.base, "GET", "/kv/logout", good)
    assert status == 303 and _cookie(headers) in ("", "\"\"")  # cleared in the browser
    assert _role(run, good) == "anonymous"  # and refused if replayed


def _role(run, cookie: str) -> str:
    return json.loads(_request(run.base, "GET", "/kv/api.json", cookie)[2])["viewer"]["role"]


def test_challenges_are_single_use_and_wrong_answers_refused(run):
    nonce = _nonce(run.base)
    status, headers, _ = _post_login(run.base, "bob-lab", nonce)
    assert status == 303 and _cookie(headers)
    status, headers, body = _post_login(run.base, "bob-lab", nonce)  # the same answer again
    assert status == 403 and _cookie(headers) is None and b"refused" in body
    status, headers, _ = _post_login(run.base, "bob-lab", _nonce(run.base), secret="alice-secret-5e1f")
    assert status == 403 and _cookie(headers) is None
    status, headers, _ = _post_login(run.base, "nobody", _nonce(run.base), secret="x")  # unknown: the same answer
    assert status == 403 and _cookie(headers) is None
    # a login posted from another site's page
    status, headers, _ = _post_login(run.base, "bob-lab", _nonce(run.base), headers={"Origin": "http://evil.example"})
    assert status == 403 and _cookie(headers) is None
    # the script's fresh challenge works like the page's
    status, _, body = _request(run.base, "POST", "/kv/login/challenge")
    assert status == 200
    status, headers, _ = _post_login(run.base, "bob-lab", json.loads(body)["nonce"])
    assert status == 303 and _cookie(headers)


def test_metrics_name_namespaces_only_when_the_operator_enables_it(run):
    body = _request(run.base, "GET", "/metrics")[2].decode()
    kv = [line for line in body.splitlines() if line.startswith("daskflow_kv_")]
    assert kv and not [line for line in kv if "namespace=" in line]
    assert not [ns for ns in TENANTS if ns in body]
    with dask.config.set({"daskflow-kv.dashboard.tenant-labels": True}):
        body = _request(run.base, "GET", "/metrics")[2].decode()
    for ns in USERS:
        assert re.search(rf'^daskflow_kv_tenant_states\{{namespace="{ns}",status="live"\}} [1-9]', body, re.M), ns
        assert re.search(rf'^daskflow_kv_tenant_bytes\{{namespace="{ns}"\}} [1-9]', body, re.M), ns


def _references_follow_definitions(item: dict) -> bool:
    """Every ``{"id": ...}`` reference in a Bokeh document comes after that object's definition,
    in document order (as BokehJS decodes it)."""
    defined = set()

    def walk(o) -> bool:
        if isinstance(o, dict):
            if "id" in o and len(o) == 1:
                return o["id"] in defined
            if "id" in o:
                defined.add(o["id"])
            return all(walk(v) for v in o.values())
        return all(walk(v) for v in o) if isinstance(o, list) else True

    return walk(item["doc"])


def test_live_plots_show_each_tenant_its_own_workflows(run):
    """Each tenant reports a workflow with a TTFT no one else has; the plots' series of a tenant
    hold its own, the admin's the cluster's; a browser that has not logged in gets no TTFT."""
    alice, bob = run.runtimes
    alice.note_workflow(1, [7.25])
    bob.note_workflow(1, [3.5])
    admin = _login(run.base, "ops-team")

    def p50(cookie=None):
        return json.loads(_request(run.base, "GET", "/kv/api.json", cookie)[2])["timeline"]["ttft_p50_s"][-1]

    deadline = time.monotonic() + 15
    while p50(admin) != pytest.approx(5.375) and time.monotonic() < deadline:  # the next sample (2 s)
        time.sleep(0.2)
    assert p50(admin) == pytest.approx(5.375)
    assert p50() is None  # a browser not logged in: totals only, no timing
    assert p50(_login(run.base, "alice-lab")) == 7.25 and p50(_login(run.base, "bob-lab")) == 3.5
    cookie = _login(run.base, "alice-lab")
    page = _request(run.base, "GET", "/kv", cookie)[2].decode()
    script = re.search(r'<script src="(/kv/static/js/bokeh\.min\.js\?v=[^"]+)"', page)
    assert 'src="/kv/static/js/bokeh-widgets.min.js?v=' in page  # the document's config needs it
    item = json.loads(re.search(r'id="kv-plots-item">(.*?)</script>', page, re.DOTALL).group(1))
    assert _references_follow_definitions(item)  # BokehJS refuses a reference to an object not yet defined
    assert script and 'id="kv-plots-item"' in page
    status, headers, body = _request(run.base, "GET", script.group(1))
    assert status == 200 and "javascript" in headers["Content-Type"] and len(body) > 100_000
    def no_nan(constant):  # a browser's JSON.parse refuses NaN / Infinity: the page would stop updating
        raise AssertionError(f"/kv/api.json sent {constant}")

    d = json.loads(_request(run.base, "GET", "/kv/api.json?html=1", cookie)[2], parse_constant=no_nan)
    assert 7.25 in d["plots"]["kv-series"]["ttft_p50_s"] and len(d["plots"]["kv-bytes"]["worker"]) == 2
