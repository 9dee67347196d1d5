"""What the KV page shows, as plain data: one snapshot of the KV scheduler plugin.

``collect`` reads the plugin through its operator views (counters, catalog rows, events)
and, where present, its catalog's states, and keeps what the viewer may see (``access``:
totals for everyone, a namespace's detail for its tenant); ``lineage_graph`` lays the states out as a
layered DAG. What each section shows is in ``kv_dashboard_view``, the HTML in
``templates/`` (rendered by ``kv_dashboard_render``), routes in ``kv_dashboard``.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter, defaultdict

from . import access
from .metrics import COUNTERS, kv_plugin, metric_name, read_catalog, read_counters

logger = logging.getLogger("daskflow_kv.dashboard")

MAX_STATES = 40  # states listed in the table (newest first)
MAX_NODES = 48  # states drawn in the lineage graph (newest, whole families)
MAX_DECISIONS = 16
MAX_EVENTS = 24
LIFECYCLE_OPS = ("materialize", "fork", "resume", "extend", "merge", "recompute", "transfer", "evict", "lost",
                 "release", "worker-lost", "over-budget", "preempt")



# ==========================================================================================
# data: one snapshot of the KV plugin, shaped for the page
# ==========================================================================================
def short_id(state_or_key: str, n: int = 6) -> str:
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
    """The plugin's whole event log as the operator sees it ([] from a plugin without one)."""
    read = getattr(plugin, "operator_events", None)
    if not callable(read):
        return []
    try:
        return [e for e in read() or () if isinstance(e, dict)]
    except Exception:  # noqa: BLE001 -- as read_counters: the page must not go down
        logger.exception("daskflow-kv: operator_events failed")
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


def _states(rows: list[dict], events: list[dict], cat_states: dict, names: dict, v: access.Viewer) -> dict:
    """Every catalogued state (all namespaces) with its blocks, from rows, events and the catalog."""
    by_state: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("state_id"):
            by_state[r["state_id"]].append(r)
    registered = {e.get("state_id"): e for e in events if e.get("op") in LIFECYCLE_OPS and "blocks" in e}
    # A block evicted and then dropped by Dask leaves the catalog ("forgotten" in its rows):
    # the event log still says why it went.
    evicted = {e.get("key"): e for e in events if e.get("op") == "evict" and e.get("key")}
    states = {}
    for sid in list(cat_states) + [s for s in by_state if s not in cat_states]:
        st = cat_states.get(sid)
        order = {access.cut_key(k, v): i for i, k in enumerate(getattr(st, "block_keys", None) or ())}
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
                "tier": r.get("tier") or "",  # memory | spilled | store | "" (see state.catalog)
                "persisted": bool(r.get("persisted", False)),
            }
            for r in brs
        ]
        _fill_ranges(blocks, int(tokens or 0))
        worker = getattr(st, "worker", None) or reg.get("worker")
        states[sid] = {
            "state_id": sid,
            "namespace": getattr(st, "namespace", None) or first.get("namespace") or reg.get("namespace"),
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
            "block_tiers": dict(Counter(b["tier"] for b in blocks if b["tier"])),
        }
    first_holder: dict[str, str] = {}  # block -> oldest state listing it (its producer, when the catalog forgot)
    for s in sorted(states.values(), key=lambda s: s["created"]):
        for b in s["blocks"]:
            first_holder.setdefault(b["key"], s["state_id"])
    for s in states.values():
        for b in s["blocks"]:
            b["producer"] = b["producer"] or first_holder.get(b["key"], "")
        s["new_blocks"] = sum(1 for b in s["blocks"] if b["producer"] == s["state_id"])
    return states


def _shown(states: dict, v: access.Viewer) -> dict:
    """The states ``v`` sees; a user's never name another namespace's state (parent, producer)."""
    shown = {sid: s for sid, s in states.items() if v.sees(s["namespace"])}
    if v.role != "admin":
        for s in shown.values():
            s["parents"] = [p for p in s["parents"] if p in shown]
            for b in s["blocks"]:
                b["producer"] = b["producer"] if b["producer"] in shown else ""
    return shown


def engine_of(plugin, addr: str) -> dict:
    """``addr``'s continuous-batching loop as last reported (zeros before its first KV task)."""
    engines = getattr(plugin, "engines", None)
    return engines.of(addr).as_dict() if engines is not None else {}


def _workers(scheduler, snap: dict, block_rows: dict, states: dict, names: dict, plugin=None) -> list[dict]:
    """KV bytes per worker against the budget, with the blocks and live states it holds, and its
    step loop's batch, step time and queue (totals)."""
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
    return [
        {
            "address": addr,
            "name": names.get(addr, addr),
            "kv_bytes": nbytes,
            "budget": budget,
            "fraction": (nbytes / budget) if budget else None,
            "blocks": in_memory.get(addr, 0),
            "live_states": live_on.get(addr, 0),
            "engine": engine_of(plugin, addr),
        }
        for addr, nbytes in sorted(kv_bytes.items(), key=lambda kv: names.get(kv[0], kv[0]))
    ]


def collect(scheduler, focus: str | None = None, viewer: access.Viewer | None = None) -> dict:
    """Everything ``viewer`` may see, as plain data (also served as ``/kv/api.json``).

    Totals for everyone (counters, KV bytes per worker, states and blocks by status); the
    states, lineage, decisions and events only of the namespaces ``viewer`` sees (none for
    an anonymous browser while tenants are configured). ``viewer`` None: a browser that has
    not logged in (everything when no tenants are configured).
    """
    plugin = kv_plugin(scheduler)
    v = access.viewer(plugin) if viewer is None else viewer
    names = _worker_names(scheduler)
    base = {
        "available": plugin is not None,
        "scheduler": getattr(scheduler, "address", ""),
        "time": time.time(),
        "focus": focus if v.detail else None,
        "viewer": v.as_dict(),
        "metric_names": {c: metric_name(c) for c in COUNTERS},
        "worker_names": names,
    }
    if plugin is None:
        return base
    snap = read_counters(plugin)
    rows = access.cut_rows(read_catalog(plugin), v)
    events = [access.cut_entry(e, v) for e in _events(plugin) or snap["events"]]
    states = _states(rows, events, _catalog_states(plugin), names, v)
    block_rows: dict[str, dict] = {}
    for r in rows:
        if r.get("block_key"):
            block_rows.setdefault(r["block_key"], r)
    listed = {b["key"] for s in states.values() for b in s["blocks"]}
    orphans = [r for k, r in block_rows.items() if k not in listed]

    out = dict(base)
    out.update(  # totals: every browser sees these
        counters=snap["counters"],
        kv_budget_bytes=snap["kv_budget_bytes"],
        workers=_workers(scheduler, snap, block_rows, states, names, plugin),
        state_status=dict(Counter(s["status"] for s in states.values())),
        block_status=dict(Counter(r.get("status", "") for r in block_rows.values())),
        block_tiers=dict(Counter(r.get("tier") or "none" for r in block_rows.values())),
        orphan_blocks={"count": len(orphans), "nbytes": sum(r.get("nbytes", 0) for r in orphans)},
        # the workflow gate's counts: cluster-wide, no run or tenant named (as on /metrics)
        gate=plugin.gate.view() if getattr(plugin, "gate", None) is not None else None,
    )
    timeline = getattr(plugin, "timeline", None)
    # The live plots: a tenant's own workflows and tokens; the admin and an open cluster's
    # browsers the cluster's; a browser not logged in the cluster's totals without timings.
    out["timeline"] = (timeline.series(v.namespace, everyone=v.role != "user", timings=v.detail)
                       if timeline is not None else None)
    if v.detail:  # the namespaces this viewer sees
        shown = _shown(states, v)
        mine = access.visible(events, v)
        out.update(
            states=sorted(shown.values(), key=lambda s: s["created"], reverse=True),
            lineage=lineage_graph(shown, mine, {b["key"]: {"lineage_state": b["producer"]} for s in shown.values()
                                                for b in s["blocks"]}, focus),
            decisions=list(reversed(access.visible(snap["decisions"], v)))[:MAX_DECISIONS],
            events=_grouped_events(mine)[:MAX_EVENTS],
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


