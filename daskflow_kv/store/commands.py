"""``daskflow-kv store ls|du|gc``: look after a persistent KV store from the shell.

    daskflow-kv store ls --kv-store /data/kv                # your blocks, newest use first
    daskflow-kv store du --kv-store s3://bucket/kv --json   # totals and an age histogram
    daskflow-kv store gc --kv-store /data/kv --older-than 7d [--dry-run]
    daskflow-kv store ls --kv-store /data/kv --all          # an admin: every tenant's objects
    daskflow-kv store migrate --kv-store /data/kv           # your objects named by full key -> keyed names

``--kv-store`` defaults to the ``daskflow-kv.store.url`` setting. Each command acts for one
tenant - ``--namespace`` (default ``daskflow-kv.namespace``) with the secret in
``daskflow-kv.secret`` (``DASK_DASKFLOW_KV__SECRET``; never a flag: flags end up in shell
histories and process lists) - and sees and touches only that tenant's directory. ``ls``
prints what its manifests hold - key, token span, bytes, dtype, fingerprint digest, times
- and never a token id.

``migrate`` renames the caller's objects written before object names were keyed (named by
their full block key, which tells whoever walks the store whose directory it is): until it
runs, reads miss them and they are recomputed (and written under keyed names); ``ls``
marks them.

``--all`` is an admin's: every tenant's objects and the legacy ``v1`` layout, by path, size
and times only (nothing else in a store is readable without the tenant's key); ``gc --all``
deletes across them. Admin means the namespace's role in ``daskflow-kv.tenants`` (the
operator's ``{name: {secret, role}}``), proven by holding its secret; with no tenants
configured (one trust domain) anyone may. This check guards the tool, not the bytes:
whoever can reach the store's URL can list and delete files with other tools - what they
cannot do is read a tenant's blocks or make it load theirs (see ``codec``).
"""

from __future__ import annotations

import hmac
import json
import time

from .. import config, validation
from ..errors import InvalidInputError


def add_store_subcommand(subparsers):
    p = subparsers.add_parser("store", help="list, size and garbage-collect a persistent KV store")
    sub = p.add_subparsers(dest="store_command", required=True)
    for name, text in (("ls", "one line per stored block (no token ids)"), ("du", "totals and ages"),
                       ("gc", "delete blocks unused for longer than --older-than"),
                       ("migrate", "rename your objects named by their full key to keyed names")):
        q = sub.add_parser(name, help=text)
        q.add_argument("--kv-store", default=None, help="directory or fsspec URL (default: daskflow-kv.store.url)")
        q.add_argument("--namespace", default=None,
                       help="tenant to act for (default: daskflow-kv.namespace; its secret comes from "
                            "DASK_DASKFLOW_KV__SECRET, never a flag)")
        if name != "migrate":
            q.add_argument("--all", action="store_true",
                           help="every tenant's objects, by path, size and times (an admin's; see daskflow-kv.tenants)")
        q.add_argument("--json", action="store_true", help="machine-readable output")
        if name == "ls":
            q.add_argument("--limit", type=int, default=None, help="at most this many rows")
        if name == "gc":
            q.add_argument("--older-than", required=True, help="age since last use, e.g. 7d, 12h")
            q.add_argument("--dry-run", action="store_true", help="report what would go; delete nothing")
    p.set_defaults(func=cmd_store)
    return p


def _when(t) -> str:
    return "-" if not t else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _url(args) -> str:
    url = config.get("store.url", args.kv_store)
    if url is None:
        raise InvalidInputError("no store: pass --kv-store URL or set daskflow-kv.store.url")
    return validation.store_url("--kv-store" if args.kv_store else "setting daskflow-kv.store.url", url)


def _tenants() -> dict:
    tenants = config.get("tenants") or {}
    if not isinstance(tenants, dict):
        raise InvalidInputError(f"setting daskflow-kv.tenants must be a mapping {{name: {{secret, role}}}}, "
                                f"got {type(tenants).__name__}")
    return tenants


def check_admin(namespace: str, secret) -> None:
    """Refuse ``--all`` unless ``namespace`` is an admin in ``daskflow-kv.tenants`` and
    ``secret`` is its secret; with no tenants configured (one trust domain) allow it."""
    tenants = _tenants()
    if not tenants:
        return
    spec = tenants.get(namespace)
    known = spec.get("secret") if isinstance(spec, dict) else None
    if not (isinstance(known, str) and isinstance(secret, str) and spec.get("role") == "admin"
            and hmac.compare_digest(known.encode(), secret.encode())):
        # One message for every failure: a wrong secret looks like an unknown namespace.
        raise InvalidInputError(f"--all is for an admin: namespace {namespace!r} is not an admin in "
                                "daskflow-kv.tenants, or daskflow-kv.secret is not its secret")


def _area_names() -> dict[str, str]:
    """Tenant directory -> namespace, for the tenants the operator's config lists."""
    from .layout import tenant_root
    from .tenant import OPEN_TENANT, StoreTenant

    names = {tenant_root(OPEN_TENANT.prefix): "(open)"}
    for name, spec in _tenants().items():
        secret = spec.get("secret") if isinstance(spec, dict) else None
        if isinstance(secret, str) and secret:
            names[tenant_root(StoreTenant.derive(str(name), secret).prefix)] = str(name)
    return names


def cmd_store(args) -> int:
    # Every input is checked before torch is imported (a bad flag answers in milliseconds).
    limit = validation.optional("--limit", getattr(args, "limit", None), validation.integer, minimum=1)
    older = validation.duration("--older-than", args.older_than) if args.store_command == "gc" else None
    url = _url(args)
    from .tenant import StoreTenant

    namespace, secret = config.get("namespace", args.namespace), config.get("secret")
    tenant = StoreTenant.derive(namespace, secret)
    every = getattr(args, "all", False)
    if every:
        check_admin(namespace, secret)
    from . import maintenance as mt
    from .kv_store import open_store

    store = open_store(url, tenant)
    whose = "every tenant" if every else f"tenant {store.root}"
    if args.store_command == "migrate":
        report = mt.migrate(store)
        if args.json:
            print(json.dumps({"url": store.url, "tenant": store.root, "renamed": report.renamed,
                              "dropped": report.dropped}, indent=1))
        else:
            print(f"{store.url} ({whose}): {report.renamed} objects renamed to keyed names; {report.dropped} that did "
                  "not open for this tenant deleted")
        return 0
    if args.store_command == "ls":
        return _ls(store, mt, limit, args)
    if args.store_command == "du":
        blocks = mt.scan_all(store.backend) if every else mt.scan(store)
        u = mt.usage(blocks, time.time(), by_area=every)
        if args.json:
            print(json.dumps({"url": store.url, "tenant": "all" if every else store.root, **u}, indent=1))
            return 0
        print(f"{store.url} ({whose}): {u['blocks']} blocks, {u['bytes'] / 2**20:.1f} MiB")
        for label, h in u["by_last_use"].items():
            print(f"  last used {label:<7}{h['blocks']:>8} blocks {h['bytes'] / 2**20:>10.1f} MiB")
        for area, h in u.get("by_tenant", {}).items():
            print(f"  {area:<36}{h['blocks']:>8} blocks {h['bytes'] / 2**20:>10.1f} MiB")
        return 0
    report = (mt.gc_all(store.backend, older, dry_run=args.dry_run) if every
              else mt.gc(store, older, dry_run=args.dry_run))
    if args.json:
        print(json.dumps({"url": store.url, "tenant": "all" if every else store.root, "dry_run": args.dry_run,
                          "older_than_s": older, "deleted": report.deleted, "bytes": report.bytes,
                          "temps": report.temps, "kept": report.kept}, indent=1))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{store.url} ({whose}): {verb} {report.deleted} blocks ({report.bytes / 2**20:.1f} MiB) unused for "
          f"more than {args.older_than}; {report.temps} abandoned temporary files; {report.kept} blocks kept")
    return 0


def _ls(store, mt, limit, args) -> int:
    if args.all:
        rows = mt.listing_all(store.backend, limit, _area_names())
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        print(f"{'tenant':<36}{'object':<50}{'bytes':>11} {'written':<17}{'last use':<17}")
        for r in rows:
            print(f"{r['namespace'] or r['tenant']:<36}{r['name']:<50}{r['object_bytes']:>11} "
                  f"{_when(r['written']):<17}{_when(r['used']):<17}")
        print(f"{len(rows)} blocks in {store.url} (every tenant)")
        return 0
    rows = mt.listing(store, limit)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{'key':<41}{'tokens':>13}{'bytes':>11} {'dtype':<9}{'fingerprint':<26}{'last use':<17}")
    for r in rows:
        span = f"[{r['start']}, {r['end']})" if r["valid_header"] else "unreadable"
        shown = (r["key"] or r["name"]) + (" (run store migrate)" if r["named_by_key"] else "")
        print(f"{shown:<41}{span:>13}{r.get('nbytes', r['object_bytes']):>11} {r.get('dtype', '-'):<9}"
              f"{r.get('fingerprint', '-'):<26}{_when(r['used']):<17}")
    print(f"{len(rows)} blocks in {store.url} (tenant {store.root})")
    return 0
