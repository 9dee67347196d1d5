"""``daskflow-kv store ls|du|gc``: look after a persistent KV store from the shell.

    daskflow-kv store ls --kv-store /data/kv                # one line per block, newest use first
    daskflow-kv store du --kv-store s3://bucket/kv --json   # totals and an age histogram
    daskflow-kv store gc --kv-store /data/kv --older-than 7d [--dry-run]

``--kv-store`` defaults to the ``daskflow-kv.store.url`` setting. ``ls`` prints what the
manifests hold - key, token span, bytes, dtype, fingerprint digest, times - and never a
token id: a store shared by tenants must not leak prompts.
"""

from __future__ import annotations

import json
import time

from .. import config, validation
from ..errors import InvalidInputError


def add_store_subcommand(subparsers):
    p = subparsers.add_parser("store", help="list, size and garbage-collect a persistent KV store")
    sub = p.add_subparsers(dest="store_command", required=True)
    for name, text in (("ls", "one line per stored block (no token ids)"), ("du", "totals and ages"),
                       ("gc", "delete blocks unused for longer than --older-than")):
        q = sub.add_parser(name, help=text)
        q.add_argument("--kv-store", default=None, help="directory or fsspec URL (default: daskflow-kv.store.url)")
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


def cmd_store(args) -> int:
    # Every input is checked before torch is imported (a bad flag answers in milliseconds).
    limit = validation.optional("--limit", getattr(args, "limit", None), validation.integer, minimum=1)
    older = validation.duration("--older-than", args.older_than) if args.store_command == "gc" else None
    url = _url(args)
    from . import maintenance as mt
    from .kv_store import open_store

    store = open_store(url)
    if args.store_command == "ls":
        rows = mt.listing(store, limit)
        if args.json:
            print(json.dumps(rows, indent=1))
            return 0
        print(f"{'key':<41}{'tokens':>13}{'bytes':>11} {'dtype':<9}{'fingerprint':<26}{'last use':<17}")
        for r in rows:
            span = f"[{r['start']}, {r['end']})" if r["valid_header"] else "unreadable"
            print(f"{r['key']:<41}{span:>13}{r.get('nbytes', r['object_bytes']):>11} {r.get('dtype', '-'):<9}"
                  f"{r.get('fingerprint', '-'):<26}{_when(r['used']):<17}")
        print(f"{len(rows)} blocks in {store.url}")
        return 0
    if args.store_command == "du":
        u = mt.usage(mt.scan(store), time.time())
        if args.json:
            print(json.dumps({"url": store.url, **u}, indent=1))
            return 0
        print(f"{store.url}: {u['blocks']} blocks, {u['bytes'] / 2**20:.1f} MiB")
        for label, h in u["by_last_use"].items():
            print(f"  last used {label:<7}{h['blocks']:>8} blocks {h['bytes'] / 2**20:>10.1f} MiB")
        return 0
    report = mt.gc(store, older, dry_run=args.dry_run)
    if args.json:
        print(json.dumps({"url": store.url, "dry_run": args.dry_run, "older_than_s": older,
                          "deleted": report.deleted, "bytes": report.bytes, "temps": report.temps,
                          "kept": report.kept}, indent=1))
        return 0
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{store.url}: {verb} {report.deleted} blocks ({report.bytes / 2**20:.1f} MiB) unused for more than "
          f"{args.older_than}; {report.temps} abandoned temporary files; {report.kept} blocks kept")
    return 0
