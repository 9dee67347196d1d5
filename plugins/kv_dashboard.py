"""The KV page of the Dask dashboard, its JSON and Arrow endpoints, and KV Prometheus metrics.

``KVDashboardPlugin`` is a scheduler plugin that adds routes to the scheduler's HTTP
server (the one serving Dask's dashboard and ``/metrics``):

* ``/kv``: one self-contained HTML page (no external scripts, styles or fonts): KV bytes
  per worker against the budget; the running counters (tokens reused vs computed, reuse
  ratio, bytes transferred, transfers vs recomputes, evictions); the lineage of the states
  (materialize -> fork -> transfer -> resume -> evict) as an SVG graph, ``?state=ID``
  narrowing it to one state's ancestors and descendants; every state with its blocks,
  token ranges, refcounts, lifecycle status and worker; the cost model's recent decisions
  with their numbers; recent lifecycle events. A few lines of script refresh it every 2 s.
* ``/kv/api.json``: the same data as JSON (``?html=1`` adds the page's rendered sections).
* ``/kv/catalog.arrow`` (Arrow IPC stream) and ``/kv/catalog.parquet``: the catalog table.
* ``/metrics``: Dask's handler, with the KV metrics of ``kv_metrics`` added for the
  scheduler it serves.

"KV" is added to the dashboard's navigation bar (and its "More..." menu), next to Dask's
own pages, when the Bokeh dashboard runs; the routes are listed in ``/sitemap.json`` too.

The numbers come from the KV scheduler plugin (``scheduler.plugins["daskflow-kv"]``)
through its RPC handlers (``handle_counters``, ``handle_catalog``) and, where present, its
catalog's states and its event log; the page shows "not loaded" until that plugin is there.

Load with ``client.register_plugin(KVDashboardPlugin())`` or
``dask scheduler --preload daskflow_kv.plugins.kv_dashboard``.
"""

from __future__ import annotations

import html
import io
import json
import logging
import math
import time
from collections import Counter, defaultdict

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.http.utils import RequestHandler
from tornado.routing import PathMatches

from . import kv_metrics
from .kv_metrics import COUNTERS, kv_plugin, metric_name, read_catalog, read_counters

logger = logging.getLogger("daskflow_kv.dashboard")

PLUGIN_NAME = "daskflow-kv-dashboard"
PAGE = "kv"  # route of the page, under the dashboard's prefix
REFRESH_MS = 2000
MAX_STATES = 40  # states listed in the table (newest first)
MAX_NODES = 48  # states drawn in the lineage graph (newest, whole families)
MAX_DECISIONS = 16
MAX_EVENTS = 24
LIFECYCLE_OPS = ("materialize", "fork", "resume", "extend", "merge", "recompute", "transfer", "evict", "lost",
                 "release", "worker-lost", "over-budget")


# ==========================================================================================
# data: one snapshot of the KV plugin, shaped for the page
# ==========================================================================================
def _short(state_or_key: str, n: int = 6) -> str:
    """kvstate-resume-4640a3ba9083 -> 4640a3 ; kvblock-32033a67... -> 32033a."""
    s = str(state_or_key or "")
    return s.rsplit("-", 1)[-1][:n] if s else ""


def _jsonable(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [_jsonable(x) for x in v]
    if v is None or isinstance(v, (str, int, bool)):
        return v
    return str(v)


def _worker_names(scheduler) -> dict[str, str]:
    out = {}
    for addr, ws in getattr(scheduler, "workers", {}).items():
        name = getattr(ws, "name", None)
        out[addr] = f"w{name}" if isinstance(name, int) or str(name).isdigit() else str(name or addr)
    return out


def _events(plugin) -> list[dict]:
    ev = getattr(plugin, "events", None)
    try:
        return [e for e in list(ev) if isinstance(e, dict)] if ev is not None else []
    except TypeError:
        return []


def _catalog_states(plugin) -> dict:
    states = getattr(getattr(plugin, "catalog", None), "states", None)
    return dict(states) if isinstance(states, dict) else {}


def _fill_ranges(blocks: list[dict], tokens: int) -> None:
    """Token ranges of blocks the catalog forgot (rows say [-1, -1)), from their place in the
    state's chain: a state's blocks cover [0, tokens) in order. Marked ``inferred``."""
    sizes = Counter(b["end"] - b["start"] for b in blocks if b["start"] >= 0)
    size = sizes.most_common(1)[0][0] if sizes else 0
    prev_end = 0
    for i, b in enumerate(blocks):
        b["inferred"] = b["start"] < 0
        if b["inferred"] and size:
            nxt = next((x["start"] for x in blocks[i + 1:] if x["start"] >= 0), None)
            b["start"] = prev_end
            b["end"] = min(prev_end + size, nxt if nxt is not None else tokens or prev_end + size)
        prev_end = max(prev_end, b["end"])


def collect(scheduler, focus: str | None = None) -> dict:
    """Everything the page shows, as plain data (also served as ``/kv/api.json``)."""
    plugin = kv_plugin(scheduler)
    names = _worker_names(scheduler)
    base = {
        "available": plugin is not None,
        "scheduler": getattr(scheduler, "address", ""),
        "time": time.time(),
        "focus": focus,
        "metric_names": {c: metric_name(c) for c in COUNTERS},
        "worker_names": names,
    }
    if plugin is None:
        return base
    snap = read_counters(plugin)
    rows = read_catalog(plugin)
    events = _events(plugin) or snap["events"]
    counters = snap["counters"]

    # -- states and their blocks ---------------------------------------------------------
    by_state: dict[str, list[dict]] = defaultdict(list)
    block_rows: dict[str, dict] = {}
    for r in rows:
        if r.get("block_key"):
            block_rows.setdefault(r["block_key"], r)
        if r.get("state_id"):
            by_state[r["state_id"]].append(r)
    registered = {e.get("state_id"): e for e in events if e.get("op") in LIFECYCLE_OPS and "blocks" in e}
    # A block evicted and then dropped by Dask leaves the catalog ("forgotten" in its rows):
    # the event log still says why it went.
    evicted = {e.get("key"): e for e in events if e.get("op") == "evict" and e.get("key")}
    cat_states = _catalog_states(plugin)
    states = {}
    for sid in list(cat_states) + [s for s in by_state if s not in cat_states]:
        st = cat_states.get(sid)
        order = {k: i for i, k in enumerate(getattr(st, "block_keys", None) or ())}
        brs = sorted(by_state.get(sid, []), key=lambda r: (order.get(r.get("block_key"), len(order)),
                                                          r.get("token_start", 0), r.get("token_end", 0)))
        first = brs[0] if brs else {}
        reg = registered.get(sid, {})
        parents = getattr(st, "parents", None)
        if parents is None:
            parents = [p for p in str(first.get("state_parents", "")).split(",") if p]
        tokens = getattr(st, "tokens", None)
        if tokens is None:
            tokens = max((r.get("token_end", 0) for r in brs), default=0)
        blocks = [
            {
                "key": r.get("block_key", ""),
                "start": r.get("token_start", -1),
                "end": r.get("token_end", -1),
                "nbytes": r.get("nbytes", 0),
                "refcount": r.get("refcount", 0),
                "status": "evicted" if r.get("block_key") in evicted and r.get("status") in ("forgotten", "released", "")
                else r.get("status", ""),
                "workers": [w for w in str(r.get("workers", "")).split(",") if w],
                "reuse_count": r.get("reuse_count", 0),
                "recomputes": r.get("recomputes", 0),
                "cached": bool(r.get("cached", False)),
                "producer": r.get("lineage_state") or "",
            }
            for r in brs
        ]
        _fill_ranges(blocks, int(tokens or 0))
        worker = getattr(st, "worker", None) or reg.get("worker")
        states[sid] = {
            "state_id": sid,
            "op": getattr(st, "op", None) or first.get("state_op") or reg.get("op", ""),
            "parents": list(parents),
            "worker": worker,
            "worker_name": names.get(worker, worker or ""),
            "tokens": int(tokens or 0),
            "status": getattr(st, "status", None) or first.get("state_status") or "live",
            "created": float(getattr(st, "created", 0.0) or reg.get("time", 0.0) or 0.0),
            "tokens_reused": reg.get("tokens_reused"),
            "tokens_computed": reg.get("tokens_computed"),
            "blocks": blocks,
            "nbytes": sum(b["nbytes"] for b in blocks),
            "refcount": max((b["refcount"] for b in blocks), default=0),
            "block_status": dict(Counter(b["status"] for b in blocks)),
        }
    first_holder: dict[str, str] = {}  # block -> oldest state listing it (its producer, when the catalog forgot)
    for s in sorted(states.values(), key=lambda s: s["created"]):
        for b in s["blocks"]:
            first_holder.setdefault(b["key"], s["state_id"])
    for s in states.values():
        for b in s["blocks"]:
            b["producer"] = b["producer"] or first_holder.get(b["key"], "")
        s["new_blocks"] = sum(1 for b in s["blocks"] if b["producer"] == s["state_id"])
    listed = {b["key"] for s in states.values() for b in s["blocks"]}
    orphans = [r for k, r in block_rows.items() if k not in listed]

    # -- workers against the budget --------------------------------------------------------
    budget = snap["kv_budget_bytes"]
    kv_bytes = dict(snap["kv_bytes"])
    for addr in getattr(scheduler, "workers", {}):
        kv_bytes.setdefault(addr, 0)
    in_memory = Counter()
    for r in block_rows.values():
        for w in str(r.get("workers", "")).split(","):
            if w:
                in_memory[w] += 1
    live_on = Counter(s["worker"] for s in states.values() if s["status"] == "live")
    workers = [
        {
            "address": addr,
            "name": names.get(addr, addr),
            "kv_bytes": nbytes,
            "budget": budget,
            "fraction": (nbytes / budget) if budget else None,
            "blocks": in_memory.get(addr, 0),
            "live_states": live_on.get(addr, 0),
        }
        for addr, nbytes in sorted(kv_bytes.items(), key=lambda kv: names.get(kv[0], kv[0]))
    ]

    out = dict(base)
    out.update(
        counters=counters,
        kv_budget_bytes=budget,
        workers=workers,
        states=sorted(states.values(), key=lambda s: s["created"], reverse=True),
        orphan_blocks={"count": len(orphans), "nbytes": sum(r.get("nbytes", 0) for r in orphans)},
        block_status=dict(Counter(r.get("status", "") for r in block_rows.values())),
        lineage=lineage_graph(states, events, {b["key"]: {"lineage_state": b["producer"]} for s in states.values()
                                               for b in s["blocks"]}, focus),
        decisions=list(reversed(snap["decisions"]))[:MAX_DECISIONS],
        events=_grouped_events(events)[:MAX_EVENTS],
    )
    return _jsonable(out)


def _grouped_events(events: list[dict]) -> list[dict]:
    """Lifecycle events newest first; a run of evict / release / lost events on one worker
    becomes one entry with ``count`` and summed ``nbytes`` (an eviction pass drops many blocks)."""
    out: list[dict] = []
    for e in reversed(events):
        op = str(e.get("op", ""))
        if op.endswith("-task"):  # placement notes, not lifecycle
            continue
        last = out[-1] if out else None
        if (last is not None and op in ("evict", "release", "lost") and last["op"] == op
                and last.get("worker") == e.get("worker")):
            last["count"] += 1
            if "nbytes" in last or "nbytes" in e:
                last["nbytes"] = (last.get("nbytes") or 0) + (e.get("nbytes") or 0)
            last["first_time"] = e.get("time")
            continue
        out.append(dict(e, count=1))
    return out


# ==========================================================================================
# lineage: a layered DAG of states, with transfer / recompute edges and evict leaves
# ==========================================================================================
NODE_W, NODE_H = 176, 46
COL_W, ROW_H = 262, 58  # column and row pitch
PAD, COMP_GAP = 14, 18


def _family(states: dict, sid: str) -> set[str]:
    """``sid``, its ancestors and its descendants."""
    children = defaultdict(set)
    for s in states.values():
        for p in s["parents"]:
            children[p].add(s["state_id"])
    seen, todo = set(), [sid]
    while todo:  # ancestors
        x = todo.pop()
        if x in seen or x not in states:
            continue
        seen.add(x)
        todo.extend(states[x]["parents"])
    todo = list(children[sid])
    while todo:  # descendants
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        todo.extend(children[x])
    return seen


def lineage_graph(states: dict, events: list[dict], block_rows: dict, focus: str | None = None) -> dict:
    """Nodes (states, evict leaves) and edges with x/y positions, newest families first cut."""
    if focus and focus in states:
        shown = _family(states, focus)
    else:
        focus = None
        # whole connected families, newest first, until MAX_NODES states
        root_of = {}

        def root(s):
            while s in root_of and root_of[s] != s:
                s = root_of[s]
            return s

        for sid in states:
            root_of.setdefault(sid, sid)
        for s in states.values():
            for p in s["parents"]:
                if p in states:
                    a, b = root(p), root(s["state_id"])
                    if a != b:
                        root_of[b] = a
        comps = defaultdict(list)
        for sid in states:
            comps[root(sid)].append(sid)
        ordered = sorted(comps.values(), key=lambda c: max(states[x]["created"] for x in c), reverse=True)
        shown = set()
        for comp in ordered:
            if shown and len(shown) + len(comp) > MAX_NODES:
                break
            shown.update(comp)
    hidden = len(states) - len(shown)

    transfers = {e.get("state_id"): e for e in events if e.get("op") == "transfer" and e.get("state_id")}
    recomputes = {e.get("state_id"): e for e in events if e.get("op") == "recompute" and e.get("state_id")}
    evicted = defaultdict(lambda: {"blocks": 0, "nbytes": 0, "workers": set()})
    for e in events:
        if e.get("op") != "evict":
            continue
        producer = (block_rows.get(e.get("key")) or {}).get("lineage_state")
        if producer in shown:
            ev = evicted[producer]
            ev["blocks"] += 1
            ev["nbytes"] += int(e.get("nbytes") or 0)
            if e.get("worker"):
                ev["workers"].add(e["worker"])

    nodes = {sid: dict(states[sid], kind="state", id=sid) for sid in shown}
    edges = []
    for sid in shown:
        for p in states[sid]["parents"]:
            if p in shown:
                kind, label = "derive", None
                if sid in transfers:
                    t = transfers[sid]
                    kind, label = "transfer", {"nbytes": t.get("nbytes"), "src": t.get("src"), "dst": t.get("dst")}
                elif sid in recomputes:
                    r = recomputes[sid]
                    kind, label = "recompute", {"tokens": r.get("tokens"), "dst": r.get("dst")}
                edges.append({"src": p, "dst": sid, "kind": kind, "label": label})
    for producer, ev in evicted.items():
        nid = f"evict:{producer}"
        nodes[nid] = {"kind": "evict", "id": nid, "state_id": producer, "blocks": ev["blocks"], "nbytes": ev["nbytes"],
                      "workers": sorted(ev["workers"]), "created": nodes[producer]["created"] + 1e-6,
                      "parents": [producer], "status": "evicted"}
        edges.append({"src": producer, "dst": nid, "kind": "evict", "label": None})

    # layers: longest path from a root; components stacked oldest first
    parents = defaultdict(list)
    for e in edges:
        parents[e["dst"]].append(e["src"])
    layer: dict[str, int] = {}

    def depth(n, guard=0):
        if n not in layer:
            layer[n] = 0 if guard > 500 else 1 + max((depth(p, guard + 1) for p in parents[n]), default=-1)
        return layer[n]

    for n in nodes:
        depth(n)
    comp_of, comp_members = {}, defaultdict(list)
    for n in sorted(nodes, key=lambda n: (layer[n], nodes[n]["created"])):
        c = next((comp_of[p] for p in parents[n] if p in comp_of), n)
        comp_of[n] = c
        comp_members[c].append(n)
    y0, width = PAD, 0
    for c in sorted(comp_members, key=lambda c: nodes[c]["created"]):
        members = comp_members[c]
        by_layer = defaultdict(list)
        for n in members:
            by_layer[layer[n]].append(n)
        rows = max(len(v) for v in by_layer.values())
        pos: dict[str, float] = {}
        for lyr in sorted(by_layer):
            col = by_layer[lyr]
            col.sort(key=lambda n: (sum(pos.get(p, 0) for p in parents[n]) / max(1, len(parents[n])),
                                    nodes[n]["created"]))
            off = (rows - len(col)) / 2
            for i, n in enumerate(col):
                pos[n] = i + off
                nodes[n]["x"] = PAD + lyr * COL_W
                nodes[n]["y"] = y0 + (i + off) * ROW_H
            width = max(width, PAD + lyr * COL_W + NODE_W + PAD)
        y0 += rows * ROW_H + COMP_GAP
    return {
        "nodes": sorted(nodes.values(), key=lambda n: (n.get("y", 0), n.get("x", 0))),
        "edges": edges,
        "width": max(width, 320),
        "height": max(y0 - COMP_GAP + PAD, 60),
        "hidden_states": hidden,
        "focus": focus,
    }


# ==========================================================================================
# rendering
# ==========================================================================================
OP_COLORS = {
    "materialize": "#2563eb", "fork": "#7c3aed", "resume": "#16a34a", "extend": "#0d9488", "merge": "#ea580c",
    "recompute": "#ca8a04", "evict": "#dc2626", "transfer": "#ea580c",
}
STATUS_COLORS = {
    "memory": "#16a34a", "pending": "#eab308", "recomputing": "#ca8a04", "released": "#a1a1aa",
    "evicted": "#dc2626", "lost": "#9333ea", "forgotten": "#d4d4d8", "erred": "#000000", "live": "#16a34a",
}
E = html.escape


def fmt_bytes(n) -> str:
    n = float(n or 0)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def fmt_int(n) -> str:
    return f"{round(float(n or 0)):,}"


def fmt_s(t) -> str:
    if t is None:
        return "–"
    t = float(t)
    if not math.isfinite(t):
        return "∞"
    return f"{t * 1e3:.1f} ms" if t < 1 else f"{t:.2f} s"


def _clock(t) -> str:
    return time.strftime("%H:%M:%S", time.localtime(float(t or 0))) + f".{int((float(t or 0) % 1) * 1000):03d}"


def _chip(text, color, title=None) -> str:
    color = {"#d4d4d8": "#71717a", "#a1a1aa": "#71717a"}.get(color, color)  # readable text for the greys
    t = f' title="{E(str(title))}"' if title else ""
    return f'<span class="chip" style="--c:{color}"{t}>{E(str(text))}</span>'


def _metric(name, value, shown) -> str:
    """A counter's value: the shown text, the exact value in data-value (read by the tests)."""
    return f'<span class="value" data-metric="{E(name)}" data-value="{E(repr(value))}">{E(shown)}</span>'


def render_cards(d: dict) -> str:
    c = d["counters"]
    names = d["metric_names"]
    reused, computed = c["tokens_reused"], c["tokens_computed"]
    total = reused + computed
    share = (reused / total * 100) if total else 0.0
    tr, rc = c["transfers"], c["recomputes"]
    ratio = f"{c['reuse_ratio'] * 100:.1f}%"
    moves = tr + rc

    def card(title, body, metrics, extra_cls=""):
        prom = " ".join(f"<code>{E(names.get(m, metric_name(m)))}</code>" for m in metrics)
        return f'<div class="card {extra_cls}"><div class="card-title">{E(title)}</div>{body}<div class="prom">{prom}</div></div>'

    split = (f'<div class="split"><div style="width:{share:.1f}%;background:#16a34a"></div>'
             f'<div style="width:{100 - share:.1f}%;background:#f59e0b"></div></div>')
    cards = [
        card("Tokens reused vs computed",
             f'<div class="big">{_metric("tokens_reused", reused, fmt_int(reused))}'
             f'<span class="vs">vs</span>{_metric("tokens_computed", computed, fmt_int(computed))}</div>{split}'
             '<div class="legend"><span class="dot" style="background:#16a34a"></span>reused from KV blocks'
             '<span class="dot" style="background:#f59e0b"></span>prefilled</div>',
             ["tokens_reused", "tokens_computed"], "wide"),
        card("Reuse ratio", f'<div class="big">{_metric("reuse_ratio", c["reuse_ratio"], ratio)}</div>'
             f'<div class="sub">of prompt tokens came from cache</div>', ["reuse_ratio"]),
        card("Bytes transferred", f'<div class="big">{_metric("bytes_transferred", c["bytes_transferred"], fmt_bytes(c["bytes_transferred"]))}</div>'
             f'<div class="sub">{fmt_int(c["bytes_transferred"])} bytes of KV moved worker to worker</div>',
             ["bytes_transferred"]),
        card("Transfers vs recomputes",
             f'<div class="big">{_metric("transfers", tr, fmt_int(tr))}<span class="vs">vs</span>'
             f'{_metric("recomputes", rc, fmt_int(rc))}</div>'
             f'<div class="split"><div style="width:{(tr / moves * 100) if moves else 0:.1f}%;background:#ea580c"></div>'
             f'<div style="width:{(rc / moves * 100) if moves else 0:.1f}%;background:#ca8a04"></div></div>'
             '<div class="legend"><span class="dot" style="background:#ea580c"></span>moved'
             '<span class="dot" style="background:#ca8a04"></span>prefilled again</div>'
             f'<div class="sub">blocks recomputed from lineage: '
             f'{_metric("lineage_recomputes", c["lineage_recomputes"], fmt_int(c["lineage_recomputes"]))}</div>',
             ["transfers", "recomputes", "lineage_recomputes"], "wide"),
        card("Evictions", f'<div class="big">{_metric("evictions", c["evictions"], fmt_int(c["evictions"]))}'
             f'<span class="unit">blocks</span></div><div class="sub">'
             f'{_metric("bytes_evicted", c["bytes_evicted"], fmt_bytes(c["bytes_evicted"]))} released under the budget</div>',
             ["evictions", "bytes_evicted"]),
    ]
    extra = [k for k in c if k not in COUNTERS]
    if extra:
        body = "".join(f'<div class="kv-line"><span>{E(k)}</span>{_metric(k, c[k], fmt_int(c[k]))}</div>' for k in extra)
        cards.append(card("Other counters", body, extra))
    return "".join(cards)


def render_workers(d: dict) -> str:
    budget = d.get("kv_budget_bytes")
    ws = d["workers"]
    if not ws:
        return '<p class="empty">No workers.</p>'
    scale = budget or max([w["kv_bytes"] for w in ws] + [1])
    out = [('<table class="tbl workers"><thead><tr><th>worker</th><th>address</th><th class="bar-col">KV bytes'
           f'{" against the budget" if budget else " (no budget: unbounded)"}</th><th class="num">KV bytes</th>'
           '<th class="num">budget</th><th class="num">blocks held</th><th class="num">live states</th></tr></thead><tbody>')]
    for w in ws:
        frac = w["kv_bytes"] / scale if scale else 0
        over = budget and w["kv_bytes"] > budget
        color = "#dc2626" if over else ("#f59e0b" if budget and frac > 0.8 else "#2563eb")
        tick = '<div class="budget-line" title="budget"></div>' if budget else ""
        out.append(
            f'<tr data-worker="{E(w["address"])}"><td><b>{E(w["name"])}</b></td><td class="mono">{E(w["address"])}</td>'
            f'<td class="bar-col"><div class="bar">{tick}<div class="fill" style="width:{min(frac, 1) * 100:.1f}%;background:{color}"></div>'
            f'<span class="bar-label">{fmt_bytes(w["kv_bytes"])}{f" / {fmt_bytes(budget)} ({frac * 100:.0f}%)" if budget else ""}</span></div></td>'
            f'<td class="num">{_metric("worker_bytes", w["kv_bytes"], fmt_int(w["kv_bytes"]))}</td>'
            f'<td class="num">{fmt_bytes(budget) if budget else "∞"}</td>'
            f'<td class="num">{w["blocks"]}</td><td class="num">{w["live_states"]}</td></tr>'
        )
    out.append("</tbody></table>")
    return "".join(out)


def _node_svg(n: dict, focus: str | None, names: dict) -> str:
    x, y = n["x"], n["y"]
    if n["kind"] == "evict":
        w = NODE_W - 40
        where = ", ".join(names.get(a, a) for a in n["workers"])
        title = f'{n["blocks"]} blocks made by {n["state_id"]} evicted ({n["nbytes"]} bytes) on {where}'
        return (f'<g class="node evict"><title>{E(title)}</title>'
                f'<rect x="{x}" y="{y}" width="{w}" height="{NODE_H}" rx="8" fill="#fef2f2" stroke="#dc2626" stroke-dasharray="4 3"/>'
                f'<text x="{x + 10}" y="{y + 19}" class="n-op" fill="#dc2626">evict</text>'
                f'<text x="{x + 10}" y="{y + 36}" class="n-sub">{n["blocks"]} blk · {E(fmt_bytes(n["nbytes"]))}'
                f'{(" · " + E(where)) if where else ""}</text></g>')
    op = n.get("op") or "state"
    color = OP_COLORS.get(op, "#475569")
    released = n.get("status") != "live"
    bs = n.get("block_status") or {}
    gone = sum(v for k, v in bs.items() if k in ("evicted", "released", "forgotten", "lost"))
    fill = "#f4f4f5" if released else "#ffffff"
    stroke = "#a1a1aa" if released else color
    dash = ' stroke-dasharray="5 3"' if released else ""
    width = 3 if n["id"] == focus else 1.5
    op_color = "#71717a" if released else color
    sub = f'{E(n.get("worker_name") or "?")} · {fmt_int(n.get("tokens"))} tok · {len(n.get("blocks") or ())} blk'
    title = (f'{n["id"]}\nop {op}, {n.get("status")}, worker {n.get("worker")}\n'
             f'tokens [0, {n.get("tokens")}), {len(n.get("blocks") or ())} blocks, {n.get("nbytes")} bytes\n'
             f'blocks: {", ".join(f"{k} {v}" for k, v in sorted(bs.items()))}\nclick: this state\'s lineage')
    badge = ""
    if gone:
        badge = (f'<rect x="{x + NODE_W - 38}" y="{y + 5}" width="32" height="14" rx="7" fill="{"#dc2626" if bs.get("evicted") else "#a1a1aa"}"/>'
                 f'<text x="{x + NODE_W - 22}" y="{y + 15.5}" class="n-badge">{gone}/{len(n.get("blocks") or ())}</text>')
    return (f'<a href="?state={E(n["id"])}" class="node-link"><g class="node{" released" if released else ""}">'
            f'<title>{E(title)}</title>'
            f'<rect x="{x}" y="{y}" width="{NODE_W}" height="{NODE_H}" rx="8" fill="{fill}" stroke="{stroke}" stroke-width="{width}"{dash}/>'
            f'<rect x="{x}" y="{y}" width="5" height="{NODE_H}" rx="2" fill="{op_color}"/>'
            f'<text x="{x + 13}" y="{y + 19}" class="n-op" fill="{op_color}">{E(op)}'
            f'<tspan class="n-id" dx="6">{E(_short(n["id"]))}</tspan></text>'
            f'<text x="{x + 13}" y="{y + 36}" class="n-sub">{sub}</text>{badge}</g></a>')


def _edge_svg(e: dict, nodes: dict, names: dict) -> str:
    a, b = nodes.get(e["src"]), nodes.get(e["dst"])
    if a is None or b is None:
        return ""
    x1, y1 = a["x"] + NODE_W, a["y"] + NODE_H / 2
    x2, y2 = b["x"], b["y"] + NODE_H / 2
    mx = (x1 + x2) / 2
    path = f"M{x1},{y1} C{mx},{y1} {mx},{y2} {x2},{y2}"
    color = {"transfer": "#ea580c", "recompute": "#ca8a04", "evict": "#dc2626"}.get(e["kind"], "#94a3b8")
    dash = ' stroke-dasharray="5 4"' if e["kind"] in ("evict", "recompute") else ""
    wid = 2.2 if e["kind"] == "transfer" else 1.4
    out = f'<path d="{path}" fill="none" stroke="{color}" stroke-width="{wid}"{dash} marker-end="url(#arr-{e["kind"]})"/>'
    lab = e.get("label")
    if lab:
        if e["kind"] == "transfer":
            l1, l2 = "transfer", f'{fmt_bytes(lab.get("nbytes"))} {names.get(lab.get("src"), "?")}→{names.get(lab.get("dst"), "?")}'
        else:
            l1, l2 = "recompute", f'{fmt_int(lab.get("tokens"))} tok on {names.get(lab.get("dst"), "?")}'
        lx, ly = x2 - 44, y2 - 1
        w = max(len(l2), len(l1)) * 5.6 + 12
        out += (f'<g class="edge-label"><rect x="{lx - w / 2}" y="{ly - 14}" width="{w}" height="27" rx="5" fill="#fff" '
                f'stroke="{color}"/><text x="{lx}" y="{ly - 2}" fill="{color}" class="e-l1">{E(l1)}</text>'
                f'<text x="{lx}" y="{ly + 9}" class="e-l2">{E(l2)}</text></g>')
    return out


def render_lineage(d: dict) -> str:
    g = d.get("lineage") or {}
    if not g.get("nodes"):
        return '<p class="empty">No states yet: run a workflow (materialize, fork, resume).</p>'
    names = d.get("worker_names") or {}
    nodes = {n["id"]: n for n in g["nodes"]}
    markers = "".join(
        f'<marker id="arr-{k}" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">'
        f'<path d="M0,0 L10,5 L0,10 z" fill="{c}"/></marker>'
        for k, c in (("derive", "#94a3b8"), ("transfer", "#ea580c"), ("recompute", "#ca8a04"), ("evict", "#dc2626")))
    edges = "".join(_edge_svg(e, nodes, names) for e in g["edges"])
    nodes_svg = "".join(_node_svg(n, g.get("focus"), names) for n in g["nodes"])
    note = ""
    if g.get("focus"):
        note = (f'<div class="note">Lineage of <b class="mono">{E(g["focus"])}</b> (ancestors and descendants). '
                f'<a href="?">show all states</a></div>')
    elif g.get("hidden_states"):
        note = f'<div class="note">{g["hidden_states"]} older states not drawn (newest families first); click a state to see its lineage.</div>'
    return (f'{note}<div class="svg-wrap"><svg class="lineage" width="{g["width"]}" height="{g["height"]}" '
            f'viewBox="0 0 {g["width"]} {g["height"]}" xmlns="http://www.w3.org/2000/svg"><defs>{markers}</defs>'
            f'{edges}{nodes_svg}</svg></div>')


def _ruler(s: dict) -> str:
    """The state's token range as its blocks, coloured by block status."""
    total = max(s["tokens"], max((b["end"] for b in s["blocks"]), default=0), 1)
    segs = []
    for b in s["blocks"]:
        if b["start"] < 0:
            continue
        w = (b["end"] - b["start"]) / total * 100
        segs.append(f'<i style="width:{w:.2f}%;background:{STATUS_COLORS.get(b["status"], "#64748b")}" '
                    f'title="[{b["start"]}, {b["end"]}) {E(b["status"])}"></i>')
    return f'<div class="ruler">{"".join(segs)}</div>'


def _inferred(b: dict) -> str:
    return ' title="inferred from the state\'s block order (the catalog no longer holds this block)"' if b.get("inferred") else ""


def render_states(d: dict) -> str:
    states = d.get("states") or []
    if not states:
        return '<p class="empty">No states in the catalog.</p>'
    names = d.get("worker_names") or {}
    out = [('<table class="tbl states"><thead><tr><th>state</th><th>op</th><th>parents</th><th>worker</th>'
           '<th class="num">tokens</th><th class="num">reused / computed</th><th>blocks (token ranges, by status)</th>'
           '<th class="num">blocks</th><th class="num">bytes</th><th class="num">refcount</th><th>status</th></tr></thead><tbody>')]
    for i, s in enumerate(states[:MAX_STATES]):
        color = OP_COLORS.get(s["op"], "#475569")
        parents = " ".join(f'<a class="mono" href="?state={E(p)}" title="{E(p)}">{E(_short(p))}</a>' for p in s["parents"]) or "–"
        rc = "–" if s.get("tokens_reused") is None else f'{fmt_int(s["tokens_reused"])} / {fmt_int(s["tokens_computed"])}'
        chips = " ".join(_chip(f"{k} {v}", STATUS_COLORS.get(k, "#64748b")) for k, v in sorted(s["block_status"].items()))
        st_color = STATUS_COLORS["live"] if s["status"] == "live" else STATUS_COLORS["released"]
        blocks = "".join(
            f'<tr><td class="mono" title="{E(b["key"])}">{E(_short(b["key"], 10))}</td><td class="num"{_inferred(b)}>[{b["start"]}, {b["end"]})</td>'
            f'<td class="num">{fmt_int(b["nbytes"])}</td><td class="num">{b["refcount"]}</td>'
            f'<td>{_chip(b["status"], STATUS_COLORS.get(b["status"], "#64748b"))}</td>'
            f'<td class="nowrap">{E(", ".join(sorted(names.get(w, w) for w in b["workers"])) or "–")}</td><td class="num">{b["reuse_count"]}</td>'
            f'<td class="num">{b["recomputes"]}</td><td>{"kept" if b["cached"] else ""}</td>'
            f'<td class="mono">{E(_short(b["producer"]) if b["producer"] != s["state_id"] else "this")}</td></tr>'
            for b in s["blocks"]
        )
        sid = E(s["state_id"])
        opened = i == 0  # the newest state's blocks are shown; the toggle opens the others
        out.append(
            f'<tr class="state-row" data-state="{sid}"><td class="nowrap"><button class="tog" data-state="{sid}" '
            f'aria-expanded="{"true" if opened else "false"}" title="blocks">{"▾" if opened else "▸"}</button>'
            f'<a class="mono" href="?state={sid}" title="{sid}">{E(_short(s["state_id"]))}</a></td>'
            f'<td><span class="op" style="color:{color}">{E(s["op"])}</span></td><td>{parents}</td>'
            f'<td title="{E(s.get("worker") or "")}">{E(s.get("worker_name") or "–")}</td>'
            f'<td class="num">[0, {s["tokens"]})</td><td class="num">{rc}</td><td class="ruler-col">{_ruler(s)}</td>'
            f'<td class="num">{len(s["blocks"])} <span class="muted">({s["new_blocks"]} new)</span></td>'
            f'<td class="num">{fmt_bytes(s["nbytes"])}</td><td class="num">{s["refcount"]}</td>'
            f'<td>{_chip(s["status"], st_color)} {chips}</td></tr>'
            f'<tr class="blocks-row" id="b-{sid}"{"" if opened else " hidden"}><td colspan="11">'
            '<table class="tbl inner"><thead><tr><th>block</th><th class="num">tokens</th><th class="num">bytes</th>'
            '<th class="num">refcount</th><th>status</th><th>held by</th><th class="num">reads</th>'
            f'<th class="num">recomputes</th><th>cache</th><th>made by</th></tr></thead><tbody>{blocks}</tbody></table></td></tr>'
        )
    out.append("</tbody></table>")
    more = len(states) - MAX_STATES
    ob = d.get("orphan_blocks") or {}
    foot = []
    if more > 0:
        foot.append(f"{more} older states not listed (all are in <code>/kv/api.json</code> and the Arrow catalog)")
    if ob.get("count"):
        foot.append(f'{ob["count"]} cached blocks no state lists ({fmt_bytes(ob["nbytes"])})')
    if foot:
        out.append(f'<div class="note">{"; ".join(foot)}.</div>')
    return "".join(out)


def render_decisions(d: dict) -> str:
    ds = d.get("decisions") or []
    if not ds:
        return '<p class="empty">No cost-model decisions yet.</p>'
    names = d.get("worker_names") or {}
    out = [('<table class="tbl"><thead><tr><th>action</th><th>src → dst</th><th class="num">prefix tokens</th>'
           '<th class="num">missing tokens</th><th class="num">KV bytes</th><th class="num">bandwidth</th>'
           '<th class="num">t transfer</th><th class="num">t recompute</th><th>reason</th></tr></thead><tbody>')]
    for x in ds:
        action = str(x.get("action", ""))
        color = {"transfer": "#ea580c", "recompute": "#ca8a04", "reuse": "#16a34a"}.get(action, "#475569")
        bw = x.get("bandwidth")
        bw_s = "–" if bw is None or (isinstance(bw, float) and not math.isfinite(bw)) else f"{fmt_bytes(bw)}/s"
        tt, tr = x.get("t_transfer"), x.get("t_recompute")
        win_t = action == "transfer"
        win_r = action == "recompute"
        out.append(
            f'<tr><td>{_chip(action, color)}</td>'
            f'<td>{E(names.get(x.get("src"), str(x.get("src") or "–")))} → {E(names.get(x.get("dst"), str(x.get("dst") or "–")))}</td>'
            f'<td class="num">{fmt_int(x.get("prefix_tokens"))}</td><td class="num">{fmt_int(x.get("missing_tokens"))}</td>'
            f'<td class="num">{fmt_bytes(x.get("nbytes"))}</td><td class="num">{bw_s}</td>'
            f'<td class="num{" win" if win_t else ""}">{fmt_s(tt)}</td><td class="num{" win" if win_r else ""}">{fmt_s(tr)}</td>'
            f'<td class="reason">{E(str(x.get("reason", "")))}</td></tr>'
        )
    out.append("</tbody></table>")
    return "".join(out)


def render_events(d: dict) -> str:
    evs = d.get("events") or []
    if not evs:
        return '<p class="empty">No lifecycle events yet.</p>'
    names = d.get("worker_names") or {}
    out = [('<table class="tbl events"><thead><tr><th>time</th><th>event</th><th>state / block</th><th>worker</th>'
           '<th>detail</th></tr></thead><tbody>')]
    skip = {"op", "time", "state_id", "key", "worker", "keys", "count", "first_time"}
    for e in evs:
        op = str(e.get("op", ""))
        n = int(e.get("count") or 1)
        what = e.get("state_id") or e.get("key") or ""
        worker = e.get("worker") or e.get("dst") or ""
        detail = ", ".join(f"{k}={v}" for k, v in e.items() if k not in skip and v not in (None, "", []))
        if op == "transfer":
            detail = f'{fmt_bytes(e.get("nbytes"))} {names.get(e.get("src"), e.get("src"))} → {names.get(e.get("dst"), e.get("dst"))}'
        elif op in ("evict", "lost", "over-budget") and e.get("nbytes") is not None:
            detail = (f"{n} blocks, " if n > 1 else "") + fmt_bytes(e.get("nbytes"))
        elif op in ("materialize", "fork", "resume", "extend", "merge"):
            parts = [f'{fmt_int(e.get("tokens"))} tokens', f'{e.get("blocks")} blocks']
            if e.get("tokens_reused") is not None:
                parts.append(f'reused {fmt_int(e.get("tokens_reused"))}, computed {fmt_int(e.get("tokens_computed"))}')
            if e.get("parents"):
                parts.append("from " + ", ".join(_short(p) for p in e["parents"]))
            detail = " · ".join(parts)
        label = f"{op} ×{n}" if n > 1 else op
        what_s = f"{_short(what, 10)} +{n - 1}" if n > 1 else _short(what, 10)
        out.append(f'<tr><td class="mono">{_clock(e.get("time"))}</td><td>{_chip(label, OP_COLORS.get(op, "#64748b"))}</td>'
                   f'<td class="mono" title="{E(str(what))}">{E(what_s)}</td>'
                   f'<td>{E(names.get(worker, str(worker)))}</td><td class="detail">{E(detail)}</td></tr>')
    out.append("</tbody></table>")
    return "".join(out)


SECTIONS = {
    "cards": render_cards,
    "workers": render_workers,
    "lineage": render_lineage,
    "states": render_states,
    "decisions": render_decisions,
    "events": render_events,
}


def render_sections(d: dict) -> dict[str, str]:
    if not d.get("available"):
        return {k: "" for k in SECTIONS}
    return {k: f(d) for k, f in SECTIONS.items()}


CSS = """
*{box-sizing:border-box}
html{background:#fafafa}
body{margin:0;font-family:"Helvetica Neue",Helvetica,Arial,"Liberation Sans","DejaVu Sans",sans-serif;color:#1f2937;font-size:13px;padding-top:46px}
.navbar{position:fixed;top:0;left:0;right:0;z-index:2;background:#eee;height:46px;display:flex;align-items:center;border-bottom:1px solid #ddd}
.navbar a{color:#000;text-decoration:none;padding:13px 14px;font-size:16px;display:block}
.navbar a:hover{background:#eaaa6d}
.navbar a.active{background:rgba(234,170,109,.7)}
.navbar img{height:26px;display:block}
.navbar .right{margin-left:auto}
main{max-width:1440px;margin:0 auto;padding:14px 18px 30px}
h1{font-size:21px;margin:4px 0 2px;font-weight:600}
h1 small{font-weight:400;color:#6b7280;font-size:13px;margin-left:8px}
h2{font-size:15px;margin:0 0 8px;font-weight:600;color:#111827;display:flex;align-items:baseline;gap:10px}
h2 .hint{font-weight:400;font-size:12px;color:#6b7280}
.topline{display:flex;gap:14px;align-items:center;color:#6b7280;margin-bottom:12px;flex-wrap:wrap}
.topline a{color:#2563eb;text-decoration:none}
.live{display:inline-block;width:8px;height:8px;border-radius:50%;background:#16a34a;margin-right:4px}
.live.stale{background:#dc2626}
section{background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:12px 14px;margin-bottom:14px}
.cards{display:flex;flex-wrap:wrap;gap:12px;margin-bottom:14px}
.card{flex:1 1 170px;background:#fff;border:1px solid #e5e7eb;border-radius:8px;padding:10px 12px;display:flex;flex-direction:column;gap:6px}
.card.wide{flex:1.7 1 280px}
.card-title{font-size:11px;text-transform:uppercase;letter-spacing:.05em;color:#6b7280;font-weight:600}
.big{font-size:24px;font-weight:600;color:#111827;white-space:nowrap}
.big .vs{font-size:13px;color:#9ca3af;font-weight:400;margin:0 8px}
.big .unit{font-size:13px;color:#6b7280;font-weight:400;margin-left:6px}
.sub{color:#6b7280;font-size:12px}
.prom{margin-top:auto;font-size:10.5px;color:#9ca3af;line-height:1.5}
.prom code{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;margin-right:6px}
.split{display:flex;height:8px;border-radius:4px;overflow:hidden;background:#f3f4f6}
.legend{font-size:11px;color:#6b7280}
.dot{display:inline-block;width:8px;height:8px;border-radius:50%;margin:0 4px 0 8px}
.dot:first-child{margin-left:0}
.kv-line{display:flex;justify-content:space-between;font-size:13px}
.tbl{border-collapse:collapse;width:100%}
.tbl th{text-align:left;font-weight:600;color:#4b5563;font-size:11.5px;border-bottom:1px solid #e5e7eb;padding:5px 8px;white-space:nowrap}
.tbl td{padding:5px 8px;border-bottom:1px solid #f3f4f6;vertical-align:middle}
.tbl .num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
.tbl td.win{font-weight:700;color:#111827}
.tbl td.reason,.tbl td.detail{color:#4b5563}
.tbl.inner{margin:2px 0 8px 26px;width:auto;min-width:760px;background:#fafafa;font-size:12px;border:1px solid #eef0f3}
.blocks-row>td{padding:0 8px;border-bottom:1px solid #e5e7eb}
.nowrap{white-space:nowrap}
button.tog{border:0;background:none;cursor:pointer;font-size:12px;color:#4b5563;width:18px;padding:0;margin-right:2px}
.tbl.inner td,.tbl.inner th{padding:3px 8px}
.mono{font-family:"DejaVu Sans Mono",Menlo,Consolas,monospace;font-size:12px}
a.mono{color:#2563eb;text-decoration:none}
.muted{color:#9ca3af}
.op{font-weight:600}
.chip{display:inline-block;padding:1px 7px;border-radius:9px;font-size:11px;color:var(--c);border:1px solid var(--c);background:#fff;white-space:nowrap;margin:1px 0}
.bar-col{width:42%}
.bar{position:relative;height:18px;background:#f3f4f6;border-radius:4px;overflow:hidden}
.bar .fill{height:100%}
.bar .budget-line{position:absolute;right:0;top:0;bottom:0;width:2px;background:#111827;opacity:.5}
.bar-label{position:absolute;left:8px;top:1px;font-size:11.5px;color:#111827;text-shadow:0 0 3px #fff,0 0 3px #fff}
.ruler-col{min-width:200px;width:22%}
.ruler{display:flex;height:12px;border-radius:3px;overflow:hidden;background:#f3f4f6;gap:1px}
.ruler i{display:block;height:100%}
.svg-wrap{overflow-x:auto}
svg.lineage .n-op{font-size:13px;font-weight:700}
svg.lineage .n-id{font-family:"DejaVu Sans Mono",Menlo,monospace;font-size:11px;font-weight:400;fill:#6b7280}
svg.lineage .n-sub{font-size:11px;fill:#4b5563}
svg.lineage .released .n-sub{fill:#9ca3af}
svg.lineage .n-badge{font-size:9.5px;fill:#fff;text-anchor:middle;font-weight:700}
svg.lineage .e-l1{font-size:10px;font-weight:700;text-anchor:middle}
svg.lineage .e-l2{font-size:9.5px;fill:#374151;text-anchor:middle}
svg.lineage a.node-link:hover rect:first-child{stroke-width:3}
.note{color:#6b7280;font-size:12px;margin:4px 0 8px}
.note a{color:#2563eb}
.empty{color:#9ca3af;margin:6px 0}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:14px}
.keys{font-size:11.5px;color:#6b7280;display:flex;gap:12px;flex-wrap:wrap;align-items:center}
.keys span{display:inline-flex;align-items:center;gap:4px}
.sw{display:inline-block;width:12px;height:10px;border-radius:2px}
.missing{background:#fff7ed;border:1px solid #fdba74;padding:14px;border-radius:8px}
@media (max-width:1100px){.grid2{grid-template-columns:1fr}}
"""

JS = """
(function(){
  var api = document.body.getAttribute('data-api');
  var focus = new URLSearchParams(location.search).get('state');
  var dot = document.getElementById('live'), stamp = document.getElementById('stamp');
  var toggled = {};  // state id -> blocks shown, as the user left them (kept across refreshes)
  function show(id, on){
    var row = document.getElementById('b-' + id), btn = document.querySelector('button.tog[data-state="' + id + '"]');
    if (!row || !btn) return;
    row.hidden = !on; btn.textContent = on ? '\u25be' : '\u25b8'; btn.setAttribute('aria-expanded', on ? 'true' : 'false');
  }
  document.addEventListener('click', function(ev){
    var btn = ev.target.closest ? ev.target.closest('button.tog') : null;
    if (!btn) return;
    var id = btn.getAttribute('data-state');
    toggled[id] = btn.getAttribute('aria-expanded') !== 'true';
    show(id, toggled[id]);
  });
  function tick(){
    var url = api + '?html=1' + (focus ? '&state=' + encodeURIComponent(focus) : '');
    fetch(url, {cache: 'no-store'}).then(function(r){ return r.json(); }).then(function(d){
      Object.keys(d.html || {}).forEach(function(k){
        var el = document.getElementById('kv-' + k);
        if (el && el.getAttribute('data-html') !== d.html[k]) { el.innerHTML = d.html[k]; el.setAttribute('data-html', d.html[k]); }
      });
      Object.keys(toggled).forEach(function(id){ show(id, toggled[id]); });
      dot.className = 'live'; stamp.textContent = new Date(d.time * 1000).toLocaleTimeString();
    }).catch(function(){ dot.className = 'live stale'; });
  }
  setInterval(tick, %(refresh)d);
})();
"""


def render_page(d: dict, prefix: str = "/", nav: list[tuple[str, str]] | None = None) -> str:
    sections = render_sections(d)
    nav = nav or []
    navbar = "".join(f'<a href="{E(prefix + url)}"{" class=active" if url == PAGE else ""}>{E(label)}</a>' for url, label in nav)
    links = (f'<a href="{E(prefix)}kv/api.json">JSON</a><a href="{E(prefix)}kv/catalog.arrow">catalog.arrow</a>'
             f'<a href="{E(prefix)}kv/catalog.parquet">catalog.parquet</a><a href="{E(prefix)}metrics">/metrics</a>')
    if not d.get("available"):
        body = ('<div class="missing">The daskflow-kv scheduler plugin is not loaded on this scheduler yet. '
                'It loads with <code>KVRuntime(client)</code>, <code>client.register_plugin(KVSchedulerPlugin())</code> '
                'or <code>dask scheduler --preload daskflow_kv.plugins.kv_scheduler</code>; this page refreshes by itself.</div>')
    else:
        budget = d.get("kv_budget_bytes")
        legend_ops = "".join(f'<span><i class="sw" style="background:{OP_COLORS[o]}"></i>{o}</span>'
                             for o in ("materialize", "fork", "resume", "extend", "merge"))
        legend_st = "".join(f'<span><i class="sw" style="background:{STATUS_COLORS[s]}"></i>{s}</span>'
                            for s in ("memory", "pending", "recomputing", "lost", "evicted", "released"))
        body = f"""
<div class="cards" id="kv-cards">{sections["cards"]}</div>
<section><h2>KV bytes per worker <span class="hint">{E(f"budget {fmt_bytes(budget)} per worker" if budget else "no per-worker budget set")}</span></h2>
<div id="kv-workers">{sections["workers"]}</div></section>
<section><h2>Lineage <span class="hint">materialize → fork → transfer → resume → evict · edges parent → child · grey dashed: released · click a state for its lineage</span></h2>
<div class="keys">{legend_ops}<span><i class="sw" style="background:#ea580c"></i>transfer edge</span><span><i class="sw" style="background:#ca8a04"></i>recompute edge</span><span><i class="sw" style="background:#dc2626"></i>evicted blocks</span></div>
<div id="kv-lineage">{sections["lineage"]}</div></section>
<section><h2>States and their blocks <span class="hint">newest first · expand a state for its blocks · refcount: live states and waiting tasks holding a block</span></h2>
<div class="keys">{legend_st}</div>
<div id="kv-states">{sections["states"]}</div></section>
<section><h2>Cost model: recent decisions <span class="hint">newest first · per destination: fetch the missing blocks (t transfer) or prefill them there (t recompute); the chosen time in bold</span></h2><div id="kv-decisions">{sections["decisions"]}</div></section>
<section><h2>Lifecycle events <span class="hint">newest first</span></h2><div id="kv-events">{sections["events"]}</div></section>"""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>KV cache · daskflow-kv</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="{E(prefix)}statics/images/favicon.ico">
<style>{CSS}</style></head>
<body data-api="{E(prefix)}kv/api.json">
<nav class="navbar"><a href="{E(prefix)}status"><img src="{E(prefix)}statics/images/dask-logo.svg" alt="Dask"></a>{navbar}
</nav>
<main>
<h1>KV cache <small>daskflow-kv on scheduler <span class="mono">{E(str(d.get("scheduler", "")))}</span></small></h1>
<div class="topline"><span><span id="live" class="live"></span>updated <span id="stamp">{E(time.strftime("%H:%M:%S", time.localtime(d["time"])))}</span>, every {REFRESH_MS // 1000} s</span>{links}</div>
{body}
</main>
<script>{JS % {"refresh": REFRESH_MS}}</script>
</body></html>"""


# ==========================================================================================
# HTTP handlers and the plugin
# ==========================================================================================
def _nav(scheduler) -> list[tuple[str, str]]:
    """Dask's navigation bar entries (when its Bokeh dashboard runs), then Info and KV."""
    pages = []
    try:
        from distributed.dashboard.scheduler import template_variables

        pages = [p for p in template_variables(scheduler)["pages"] if p != PAGE]
    except Exception:  # noqa: BLE001 -- no Bokeh: Dask serves only the HTML info pages
        pages = ["info"]
    return [(p, p.title()) for p in pages] + [(PAGE, "KV")]


class _KVHandler(RequestHandler):
    def prefix(self) -> str:
        return self.extra.get("prefix", "/")


class KVPageHandler(_KVHandler):
    def get(self):
        focus = self.get_argument("state", None) or None
        d = collect(self.server, focus)
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.write(render_page(d, self.prefix(), _nav(self.server)))


class KVApiHandler(_KVHandler):
    def get(self):
        focus = self.get_argument("state", None) or None
        d = collect(self.server, focus)
        if self.get_argument("html", None):
            d["html"] = render_sections(d)
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.write(json.dumps(d, default=str))


def catalog_table(scheduler):
    """The KV catalog of ``scheduler`` as a pyarrow Table (empty, with the schema, when none)."""
    from daskflow_kv.runtime.catalog import rows_to_arrow

    plugin = kv_plugin(scheduler)
    if plugin is not None and hasattr(plugin, "catalog_table"):
        try:
            return plugin.catalog_table()
        except Exception:  # a plugin mid-refactor: build the table from the rows
            logger.exception("daskflow-kv: catalog_table failed; building it from the rows")
    return rows_to_arrow(read_catalog(plugin) if plugin is not None else [])


class KVArrowHandler(_KVHandler):
    def get(self):
        import pyarrow as pa

        table = catalog_table(self.server)
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        self.set_header("Content-Type", "application/vnd.apache.arrow.stream")
        self.set_header("Content-Disposition", 'attachment; filename="kv-catalog.arrow"')
        self.write(sink.getvalue().to_pybytes())


class KVParquetHandler(_KVHandler):
    def get(self):
        import pyarrow.parquet as pq

        buf = io.BytesIO()
        pq.write_table(catalog_table(self.server), buf)
        self.set_header("Content-Type", "application/vnd.apache.parquet")
        self.set_header("Content-Disposition", 'attachment; filename="kv-catalog.parquet"')
        self.write(buf.getvalue())


def _http_prefix(scheduler) -> str:
    """The dashboard's URL prefix (Scheduler(http_prefix=...)), read off its /metrics route."""
    app = getattr(scheduler, "http_application", None)
    for router in (getattr(app, "wildcard_router", None), getattr(app, "default_router", None)):
        for rule in getattr(router, "rules", []):
            m = rule.matcher
            if isinstance(m, PathMatches) and m.regex.pattern.rstrip("$").endswith("/metrics"):
                return m.regex.pattern.rstrip("$")[: -len("metrics")]
    return "/"


def _add_to_navbar(scheduler) -> bool:
    """Add KV to the Bokeh dashboard's navigation bar and "More..." menu (when it runs).

    Dask builds both from ``distributed.dashboard.scheduler.template_variables(scheduler)``,
    memoized per scheduler; its lists are shared with the pages' templates, so an entry
    appended here shows on every dashboard page rendered afterwards.
    """
    try:
        from distributed.dashboard.scheduler import template_variables

        tv = template_variables(scheduler)
    except Exception:  # noqa: BLE001 -- no Bokeh dashboard: nothing to add to
        return False
    pages, plots = tv.get("pages"), tv.get("plots")
    if isinstance(pages, list) and PAGE not in pages:
        pages.insert(pages.index("info") + 1 if "info" in pages else len(pages), PAGE)
    if isinstance(plots, list) and not any(isinstance(p, dict) and p.get("url") == PAGE for p in plots):
        plots.append({"url": PAGE, "name": "KV Cache"})
        plots.sort(key=lambda p: p.get("name", ""))
    return True


class KVDashboardPlugin(SchedulerPlugin):
    """Adds the KV page, its JSON/Arrow/Parquet endpoints and KV Prometheus metrics."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self, metrics: bool = True):
        self.metrics = metrics  # report the KV metrics under /metrics
        self.scheduler = None
        self._rule = None

    async def start(self, scheduler) -> None:
        self.scheduler = scheduler
        app = getattr(scheduler, "http_application", None)
        if app is None:  # a scheduler started without its HTTP server
            logger.info("daskflow-kv dashboard: the scheduler has no HTTP server")
            return
        prefix = _http_prefix(scheduler)
        kw = {"dask_server": scheduler, "extra": {"prefix": prefix}}
        routes = [
            (rf"{prefix}{PAGE}/?", KVPageHandler, kw),
            (rf"{prefix}{PAGE}/api\.json", KVApiHandler, kw),
            (rf"{prefix}{PAGE}/catalog\.arrow", KVArrowHandler, kw),
            (rf"{prefix}{PAGE}/catalog\.parquet", KVParquetHandler, kw),
        ]
        if self.metrics and kv_metrics.install(scheduler):
            handler = kv_metrics.prometheus_handler_class()
            if handler is not None:  # Dask's /metrics, telling our collector which scheduler it serves
                routes.append((rf"{prefix}metrics", handler, {"dask_server": scheduler}))
        # add_handlers puts these ahead of the routes the server started with
        app.add_handlers(r".*", routes)
        self._rule = app.default_router.rules[-2]
        _add_to_navbar(scheduler)

    async def close(self) -> None:
        if self.scheduler is None:
            return
        kv_metrics.uninstall(self.scheduler)
        app = getattr(self.scheduler, "http_application", None)
        if app is not None and self._rule is not None:
            try:
                app.default_router.rules.remove(self._rule)
            except ValueError:
                pass
        self._rule = None


async def dask_setup(scheduler) -> None:
    """Entry point for ``dask scheduler --preload daskflow_kv.plugins.kv_dashboard``."""
    await scheduler.register_scheduler_plugin(KVDashboardPlugin(), name=PLUGIN_NAME, idempotent=True)
