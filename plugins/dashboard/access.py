"""Who is looking at the KV pages, and what of the KV plugin's data they may see.

With tenants configured (``daskflow-kv.tenants``), a browser that has not logged in is
*anonymous*: it gets totals only (counters, KV bytes per worker, states and blocks counted
by status), never a namespace, a state id, a block key, a prompt length, a timing or a
decision. A browser logged in as a tenant (``session``) sees its own namespace's states,
blocks, decisions and events; the admin role sees every namespace. With no tenants the
scheduler is one trust domain and every browser sees everything, as before tenancy.

Whenever tenants are configured, every key on the pages is cut short (``keys.short_key``):
a full block key is a capability to fetch the block's K/V from Dask. Pure functions of
plain data; the routes (``plugin``, ``login``) decide who the viewer is.
"""

from __future__ import annotations

from dataclasses import dataclass

from daskflow_kv import config
from daskflow_kv.keys import short_key

ROW_KEYS = ("block_key", "parent_key")  # catalog columns holding keys
EVENT_KEYS = ("key", "keys")  # event and decision fields holding keys


@dataclass(frozen=True, slots=True)
class Viewer:
    role: str  # anonymous | user | admin
    namespace: str | None  # the tenant logged in (None: anonymous, or no tenants); an admin sees all
    tenants: bool  # tenants are configured: keys cut short, anonymous sees totals only

    @property
    def detail(self) -> bool:
        """Sees states, blocks, decisions and events (of some namespace), not only totals."""
        return self.role != "anonymous"

    def sees(self, namespace: str | None) -> bool:
        """May this viewer see the detail of something ``namespace`` owns?"""
        return self.role == "admin" or (self.role == "user" and namespace == self.namespace)

    def as_dict(self) -> dict:
        return {"role": self.role, "namespace": self.namespace, "tenants": self.tenants, "detail": self.detail}


EVERYONE = Viewer("admin", None, False)  # no tenants configured: one trust domain
ANONYMOUS = Viewer("anonymous", None, True)


def tenants_configured(plugin) -> bool:
    """The KV plugin's tenant registry is not open (the scheduler's config when it has none)."""
    registry = getattr(plugin, "tenants", None)
    if registry is not None and hasattr(registry, "open"):
        return not registry.open
    return bool(config.get("tenants"))


def viewer(plugin, session=None) -> Viewer:
    """Who a request is: everyone without tenants; else the logged-in ``session`` or anonymous."""
    if not tenants_configured(plugin):
        return EVERYONE
    if session is None:
        return ANONYMOUS
    return Viewer(session.role, session.namespace, True)


# -- keys cut short -----------------------------------------------------------------------------
def cut_rows(rows: list[dict], v: Viewer) -> list[dict]:
    """Catalog rows with their keys cut short when tenants are configured (the plugin's
    operator view already does; the dashboard does not rely on it)."""
    if not v.tenants:
        return rows
    return [dict(r, **{k: short_key(r[k]) for k in ROW_KEYS if r.get(k)}) for r in rows]


def cut_entry(e: dict, v: Viewer) -> dict:
    """An event or decision with its keys cut short when tenants are configured."""
    if not v.tenants:
        return e
    out = dict(e)
    if out.get("key"):
        out["key"] = short_key(out["key"])
    if isinstance(out.get("keys"), (list, tuple)):
        out["keys"] = [short_key(k) for k in out["keys"]]
    return out


def cut_key(key: str, v: Viewer) -> str:
    return short_key(key) if v.tenants else key


# -- scoped to the viewer -----------------------------------------------------------------------
def visible(entries, v: Viewer) -> list[dict]:
    """The events or decisions ``v`` may see, keys cut: a user only its namespace's (not even
    the cluster's own, which may name another tenant), an admin all, anonymous none."""
    return [cut_entry(e, v) for e in entries if v.sees(e.get("namespace"))]


def totals_table(rows: list[dict]):
    """The catalog as an anonymous browser may see it: blocks counted, and their bytes summed,
    by status and tier (one row per pair), as a pyarrow Table."""
    import pyarrow as pa

    blocks: dict[str, dict] = {}
    for r in rows:
        if r.get("block_key"):
            blocks.setdefault(r["block_key"], r)
    counts: dict[tuple[str, str], list[int]] = {}
    for r in blocks.values():
        c = counts.setdefault((str(r.get("status") or ""), str(r.get("tier") or "")), [0, 0])
        c[0] += 1
        c[1] += int(r.get("nbytes") or 0)
    pairs = sorted(counts)
    return pa.table({
        "status": pa.array([s for s, _ in pairs], pa.string()),
        "tier": pa.array([t for _, t in pairs], pa.string()),
        "blocks": pa.array([counts[p][0] for p in pairs], pa.int64()),
        "nbytes": pa.array([counts[p][1] for p in pairs], pa.int64()),
    })
