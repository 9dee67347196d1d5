"""What each section of the KV page shows: the snapshot shaped for its templates.

Pure functions of the snapshot ``kv_dashboard_data.collect`` returns; one per section of
the page (``SECTIONS``), each returning plain dicts and lists: which colour a chip has, where
a lineage node sits, which text a cell holds. The markup is in ``templates/``, rendered by
``kv_dashboard_render``.
"""

from __future__ import annotations

import math

from .data import MAX_STATES, NODE_H, NODE_W, short_id
from .format import fmt_bytes, fmt_int
from .metrics import COUNTERS, GATE_FAMILIES, PREFIX, metric_name

OP_COLORS = {
    "materialize": "#2563eb", "fork": "#7c3aed", "resume": "#16a34a", "extend": "#0d9488", "merge": "#ea580c",
    "recompute": "#ca8a04", "evict": "#dc2626", "transfer": "#ea580c",
}
STATUS_COLORS = {
    "memory": "#16a34a", "pending": "#eab308", "recomputing": "#ca8a04", "released": "#a1a1aa",
    "evicted": "#dc2626", "lost": "#9333ea", "forgotten": "#d4d4d8", "erred": "#000000", "live": "#16a34a",
}
TIER_COLORS = {"memory": "#16a34a", "spilled": "#d97706", "store": "#2563eb", "": "#d4d4d8"}  # where the bytes are
EDGE_COLORS = {"derive": "#94a3b8", "transfer": "#ea580c", "recompute": "#ca8a04", "evict": "#dc2626"}
ACTION_COLORS = {"transfer": "#ea580c", "recompute": "#ca8a04", "reuse": "#16a34a", "load": "#2563eb"}
OTHER = "#64748b"  # a status or event the page has no colour for
LEGEND_OPS = ("materialize", "fork", "resume", "extend", "merge")
LEGEND_STATUSES = ("memory", "pending", "recomputing", "lost", "evicted", "released")
GONE = ("evicted", "released", "forgotten", "lost")  # block statuses counted in a node's badge
EVENT_DETAIL_SKIP = {"op", "time", "state_id", "key", "worker", "keys", "count", "first_time"}


def chip(text, color) -> dict:
    """A coloured label; the greys get a darker text colour to stay readable."""
    return {"text": str(text), "color": {"#d4d4d8": "#71717a", "#a1a1aa": "#71717a"}.get(color, color)}


def _pct(part, whole) -> float:
    return (part / whole * 100) if whole else 0.0


# -- cards -----------------------------------------------------------------------------------
def cards(d: dict) -> dict:
    c = d["counters"]
    names = d["metric_names"]
    reused, computed, tr, rc = c["tokens_reused"], c["tokens_computed"], c["transfers"], c["recomputes"]
    share = _pct(reused, reused + computed)
    return {
        "c": c,
        "series": {k: names.get(k, metric_name(k)) for k in list(COUNTERS) + list(c)}
        | {name: PREFIX + name for name, _ in GATE_FAMILIES},
        "gate": d.get("gate"),
        "reused_pct": share,
        "computed_pct": 100 - share,
        "transfer_pct": _pct(tr, tr + rc),
        "recompute_pct": _pct(rc, tr + rc),
        "extra": [k for k in c if k not in COUNTERS],  # the plugin's counters this page has no card for
    }


# -- workers ---------------------------------------------------------------------------------
def workers(d: dict) -> dict:
    budget = d.get("kv_budget_bytes")
    ws = d["workers"]
    scale = budget or max([w["kv_bytes"] for w in ws] + [1])
    rows = []
    for w in ws:
        frac = w["kv_bytes"] / scale if scale else 0
        over = budget and w["kv_bytes"] > budget
        rows.append(dict(w, frac=frac, width=min(frac, 1) * 100,
                         color="#dc2626" if over else ("#f59e0b" if budget and frac > 0.8 else "#2563eb")))
    return {"budget": budget, "rows": rows}


# -- lineage ---------------------------------------------------------------------------------
def _evict_node(n: dict, names: dict) -> dict:
    where = ", ".join(names.get(a, a) for a in n["workers"])
    return {
        "kind": "evict", "x": n["x"], "y": n["y"], "w": NODE_W - 40, "h": NODE_H,
        "title": f'{n["blocks"]} blocks made by {n["state_id"]} evicted ({n["nbytes"]} bytes) on {where}',
        "sub": f'{n["blocks"]} blk · {fmt_bytes(n["nbytes"])}' + (f" · {where}" if where else ""),
    }


def _state_node(n: dict, focus: str | None) -> dict:
    op = n.get("op") or "state"
    color = OP_COLORS.get(op, "#475569")
    released = n.get("status") != "live"
    bs = n.get("block_status") or {}
    nblocks = len(n.get("blocks") or ())
    gone = sum(v for k, v in bs.items() if k in GONE)
    blocks = ", ".join(f"{k} {v}" for k, v in sorted(bs.items()))
    return {
        "kind": "state", "id": n["id"], "short": short_id(n["id"]), "op": op, "released": released,
        "x": n["x"], "y": n["y"], "w": NODE_W, "h": NODE_H,
        "fill": "#f4f4f5" if released else "#ffffff",
        "stroke": "#a1a1aa" if released else color,
        "stroke_width": 3 if n["id"] == focus else 1.5,
        "op_color": "#71717a" if released else color,
        "sub": f'{n.get("worker_name") or "?"} · {fmt_int(n.get("tokens"))} tok · {nblocks} blk',
        "title": (f'{n["id"]}\nop {op}, {n.get("status")}, worker {n.get("worker")}\n'
                  f'tokens [0, {n.get("tokens")}), {nblocks} blocks, {n.get("nbytes")} bytes\n'
                  f"blocks: {blocks}\nclick: this state's lineage"),
        # "gone/all" blocks, red when some were evicted
        "badge": {"text": f"{gone}/{nblocks}", "fill": "#dc2626" if bs.get("evicted") else "#a1a1aa"} if gone else None,
    }


def _edge(e: dict, nodes: dict, names: dict) -> dict | None:
    a, b = nodes.get(e["src"]), nodes.get(e["dst"])
    if a is None or b is None:
        return None
    x1, y1 = a["x"] + NODE_W, a["y"] + NODE_H / 2
    x2, y2 = b["x"], b["y"] + NODE_H / 2
    mx = (x1 + x2) / 2
    kind = e["kind"]
    out = {
        "kind": kind, "path": f"M{x1},{y1} C{mx},{y1} {mx},{y2} {x2},{y2}",
        "color": EDGE_COLORS.get(kind, EDGE_COLORS["derive"]),
        "dashed": kind in ("evict", "recompute"), "width": 2.2 if kind == "transfer" else 1.4, "label": None,
    }
    lab = e.get("label")
    if lab:
        if kind == "transfer":
            l1, l2 = "transfer", f'{fmt_bytes(lab.get("nbytes"))} {names.get(lab.get("src"), "?")}→{names.get(lab.get("dst"), "?")}'
        else:
            l1, l2 = "recompute", f'{fmt_int(lab.get("tokens"))} tok on {names.get(lab.get("dst"), "?")}'
        # centred just left of the arrow head; width estimated from the longer line
        out["label"] = {"x": x2 - 44, "y": y2 - 1, "w": max(len(l2), len(l1)) * 5.6 + 12, "l1": l1, "l2": l2}
    return out


def lineage(d: dict) -> dict:
    g = d.get("lineage") or {}
    if not g.get("nodes"):
        return {"nodes": []}
    names = d.get("worker_names") or {}
    nodes = {n["id"]: n for n in g["nodes"]}
    edges = (_edge(e, nodes, names) for e in g["edges"])
    return {
        "width": g["width"], "height": g["height"], "focus": g.get("focus"), "hidden": g.get("hidden_states"),
        "markers": list(EDGE_COLORS.items()),
        "edges": [e for e in edges if e is not None],
        "nodes": [_evict_node(n, names) if n["kind"] == "evict" else _state_node(n, g.get("focus"))
                  for n in g["nodes"]],
    }


# -- states and their blocks -----------------------------------------------------------------
def _ruler(s: dict) -> list[dict]:
    """The state's token range as its blocks, coloured by block status."""
    total = max(s["tokens"], max((b["end"] for b in s["blocks"]), default=0), 1)
    return [{"width": (b["end"] - b["start"]) / total * 100, "color": STATUS_COLORS.get(b["status"], OTHER),
             "title": f'[{b["start"]}, {b["end"]}) {b["status"]}'}
            for b in s["blocks"] if b["start"] >= 0]


def _block(b: dict, sid: str, names: dict) -> dict:
    tier = b.get("tier") or ""
    return dict(b, short=short_id(b["key"], 10), chip=chip(b["status"], STATUS_COLORS.get(b["status"], OTHER)),
                tier_chip=chip((tier or "–") + (" +store" if b.get("persisted") and tier != "store" else ""),
                               TIER_COLORS.get(tier, OTHER)),
                held_by=", ".join(sorted(names.get(w, w) for w in b["workers"])) or "–",
                made_by=short_id(b["producer"]) if b["producer"] != sid else "this")


def _state(s: dict, newest: bool, names: dict) -> dict:
    sid = s["state_id"]
    return dict(
        s, id=sid, short=short_id(sid), color=OP_COLORS.get(s["op"], "#475569"),
        parents=[(p, short_id(p)) for p in s["parents"]],
        reused_computed="–" if s.get("tokens_reused") is None
        else f'{fmt_int(s["tokens_reused"])} / {fmt_int(s["tokens_computed"])}',
        ruler=_ruler(s),
        status_chip=chip(s["status"], STATUS_COLORS["live"] if s["status"] == "live" else STATUS_COLORS["released"]),
        block_chips=[chip(f"{k} {v}", STATUS_COLORS.get(k, OTHER)) for k, v in sorted(s["block_status"].items())]
        + [chip(f"{k} {v}", TIER_COLORS[k]) for k, v in sorted((s.get("block_tiers") or {}).items())
           if k in ("spilled", "store")],  # tiers other than memory
        blocks=[_block(b, sid, names) for b in s["blocks"]],
        opened=newest,  # the newest state's blocks are shown; the toggle opens the others
    )


def _totals(d: dict) -> dict:
    """States and blocks counted by status: what a browser that has not logged in sees."""
    ss, bs = d.get("state_status") or {}, d.get("block_status") or {}
    return {
        "states": sum(ss.values()), "blocks": sum(bs.values()),
        "state_chips": [chip(f"{k} {v}", STATUS_COLORS.get(k, OTHER)) for k, v in sorted(ss.items())],
        "block_chips": [chip(f"{k} {v}", STATUS_COLORS.get(k, OTHER)) for k, v in sorted(bs.items())],
    }


def states(d: dict) -> dict:
    ss = d.get("states") or []
    names = d.get("worker_names") or {}
    ob = d.get("orphan_blocks") or {}
    return {
        "rows": [_state(s, i == 0, names) for i, s in enumerate(ss[:MAX_STATES])],
        "more": max(len(ss) - MAX_STATES, 0),  # older states not listed
        "orphans": ob if ob.get("count") else None,  # cached blocks no state lists
        "totals": _totals(d),
    }


# -- cost-model decisions --------------------------------------------------------------------
def decisions(d: dict) -> list[dict]:
    names = d.get("worker_names") or {}
    rows = []
    for x in d.get("decisions") or []:
        action = str(x.get("action", ""))
        bw = x.get("bandwidth")
        rows.append({
            "chip": chip(action, ACTION_COLORS.get(action, "#475569")),
            "src": names.get(x.get("src"), str(x.get("src") or "–")),
            "dst": names.get(x.get("dst"), str(x.get("dst") or "–")),
            "prefix_tokens": x.get("prefix_tokens"), "missing_tokens": x.get("missing_tokens"), "nbytes": x.get("nbytes"),
            "bandwidth": None if bw is None or (isinstance(bw, float) and not math.isfinite(bw)) else bw,
            "t_transfer": x.get("t_transfer"), "t_recompute": x.get("t_recompute"),
            "chosen": action,  # its time is the one in bold
            "reason": str(x.get("reason", "")),
        })
    return rows


# -- lifecycle events ------------------------------------------------------------------------
def _event_detail(e: dict, op: str, n: int, names: dict) -> str:
    if op == "transfer":
        return f'{fmt_bytes(e.get("nbytes"))} {names.get(e.get("src"), e.get("src"))} → {names.get(e.get("dst"), e.get("dst"))}'
    if op in ("evict", "lost", "over-budget") and e.get("nbytes") is not None:
        return (f"{n} blocks, " if n > 1 else "") + fmt_bytes(e.get("nbytes"))
    if op in ("materialize", "fork", "resume", "extend", "merge"):
        parts = [f'{fmt_int(e.get("tokens"))} tokens', f'{e.get("blocks")} blocks']
        if e.get("tokens_reused") is not None:
            parts.append(f'reused {fmt_int(e.get("tokens_reused"))}, computed {fmt_int(e.get("tokens_computed"))}')
        if e.get("parents"):
            parts.append("from " + ", ".join(short_id(p) for p in e["parents"]))
        return " · ".join(parts)
    return ", ".join(f"{k}={v}" for k, v in e.items() if k not in EVENT_DETAIL_SKIP and v not in (None, "", []))


def events(d: dict) -> list[dict]:
    names = d.get("worker_names") or {}
    rows = []
    for e in d.get("events") or []:
        op = str(e.get("op", ""))
        n = int(e.get("count") or 1)  # a run of evictions on one worker is one entry
        what = e.get("state_id") or e.get("key") or ""
        worker = e.get("worker") or e.get("dst") or ""
        rows.append({
            "time": e.get("time"),
            "chip": chip(f"{op} ×{n}" if n > 1 else op, OP_COLORS.get(op, OTHER)),
            "what": str(what), "what_short": f"{short_id(what, 10)} +{n - 1}" if n > 1 else short_id(what, 10),
            "worker": names.get(worker, str(worker)),
            "detail": _event_detail(e, op, n, names),
        })
    return rows


SECTIONS = {
    "cards": cards,
    "workers": workers,
    "lineage": lineage,
    "states": states,
    "decisions": decisions,
    "events": events,
}


def viewer(d: dict) -> dict:
    """Who is looking (``access.Viewer.as_dict``), and the name the page greets them by."""
    v = d.get("viewer") or {"role": "admin", "namespace": None, "tenants": False, "detail": True}
    return dict(v, name=v.get("namespace") or "")


def sections(d: dict) -> dict:
    """Every section's view, by section name (the templates' ``kv_<name>.html``), and the viewer."""
    return {name: f(d) for name, f in SECTIONS.items()} | {"viewer": viewer(d)}


def nav_items(prefix: str, nav: list[tuple[str, str]], current: str) -> list[dict]:
    """The navigation bar's links (``kv_macros.navbar``)."""
    return [{"href": prefix + url, "label": label, "active": url == current} for url, label in nav]


def page(d: dict, prefix: str, nav: list[tuple[str, str]], current: str, refresh_s: float) -> dict:
    """The page around the sections: navigation, links, legends, who is looking."""
    return {
        "available": bool(d.get("available")),
        "viewer": viewer(d),
        "prefix": prefix,
        "nav": nav_items(prefix, nav, current),
        "scheduler": str(d.get("scheduler", "")),
        "time": d["time"],
        "refresh_s": refresh_s,  # shown on the page
        "refresh_ms": round(refresh_s * 1000),  # read by kv.js
        "budget": d.get("kv_budget_bytes"),
        "legend_ops": [(o, OP_COLORS[o]) for o in LEGEND_OPS],
        "legend_statuses": [(s, STATUS_COLORS[s]) for s in LEGEND_STATUSES],
    }
