"""Where a result came from: its commit, its host, its libraries, its command and wall time.

Every JSON a benchmark writes carries ``provenance`` (``stamp``; ``common.write_json`` calls
it), so a figure can be traced to the code and the machine that made it:

- ``commit``: the HEAD of the checkout the process ran from, and ``dirty_files``: what git
  saw changed or untracked beside it (benchmarks/results/ left out: runs write there). Read
  once per process, at the first call: the code a long run loaded is the code at its start.
- ``host``: CPU model, cores and memory (whole GiB), and ``id``, a hash of the three that is
  the same in every process on one machine (Python's ``hash()`` is salted per process).
- ``versions`` of python, torch, transformers, dask and distributed; the ``command`` and the
  process's ``wall_s`` so far.

Rows from different commits or hosts are not comparable without saying so: ``check`` refuses
them in one line unless the caller passes ``across_commits`` / ``across_hosts`` (the
``--across-commits`` / ``--across-hosts`` flags of the tools that read several runs). A JSON
from before provenance has no commit ("not recorded"); its host is read from ``machine``.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from ..errors import InvalidInputError

ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = ("benchmarks/results/",)  # written by the runs themselves: not a change to what ran
LIBRARIES = ("torch", "transformers", "dask", "distributed")
MAX_DIRTY_NAMES = 40  # a tree with more changes names the first ones and counts the rest
_IMPORTED_AT = time.time()


class IncomparableResults(InvalidInputError):
    """Two results come from different commits or hosts, and the caller did not allow it."""


def git(*args: str, root: Path = ROOT) -> str | None:
    """``git args`` in ``root``, its stdout less the final newline; None when git or the
    repository is missing."""
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.rstrip("\n") if out.returncode == 0 else None


@functools.cache
def git_state(root: Path = ROOT) -> dict:
    """The commit checked out at ``root`` and the files changed beside it (read once per process)."""
    commit = git("rev-parse", "HEAD", root=root)
    if commit is None:
        return {"commit": None, "dirty": None, "dirty_files": []}
    entries = iter((git("status", "--porcelain", "-z", "--untracked-files=all", root=root) or "").split("\0"))
    names = set()
    for entry in entries:  # "XY path"; a rename or copy is followed by its old path
        if len(entry) > 3:
            names.add(entry[3:])
            if entry[0] in "RC":
                next(entries, None)
    names = sorted(names)
    names = [n for n in names if not n.startswith(OUTPUTS)]
    return {"commit": commit, "dirty": bool(names), "dirty_files": names[:MAX_DIRTY_NAMES],
            "dirty_count": len(names)}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    """Total memory as ``common.machine_info`` has always read it (psutil), so a result from
    before provenance gets the same host id from its ``machine`` facts."""
    try:
        import psutil

        return psutil.virtual_memory().total
    except Exception:  # noqa: BLE001 -- psutil is a distributed dependency; sysconf is the fallback
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None


def host_of(cpu: str | None, cores: int | None, memory_bytes: int | None) -> dict:
    """A host's fingerprint: the three facts and a hash of them (memory in whole GiB: the
    kernel's count moves by a few MiB between boots)."""
    gib = None if memory_bytes is None else round(memory_bytes / 2**30)
    digest = hashlib.sha256(f"{cpu}|{cores}|{gib}".encode()).hexdigest()[:12]
    return {"cpu": cpu, "cores": cores, "memory_gib": gib, "id": digest}


@functools.cache
def host() -> dict:
    """This machine's fingerprint (``host_of``)."""
    return host_of(_cpu_model(), os.cpu_count(), _memory_bytes())


def versions() -> dict:
    """The libraries a timing depends on, read from their installed metadata (nothing imported)."""
    out = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _process_start() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # noqa: BLE001 -- psutil is a distributed dependency; the import time is the fallback
        return _IMPORTED_AT


def record(command: str | None = None) -> dict:
    """The provenance of a result written now by this process."""
    argv = " ".join([os.path.basename(sys.executable), *(shlex.quote(a) for a in sys.argv)])
    return {**git_state(), "host": host(), "versions": versions(), "command": command or argv,
            "wall_s": round(time.time() - _process_start(), 1),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def stamp(doc: dict, command: str | None = None) -> dict:
    """``doc`` with its ``provenance`` (``record``); the command is the doc's own when it has one."""
    own = doc.get("command")
    doc["provenance"] = record(command or (own if isinstance(own, str) else None))
    return doc


def origin(doc: dict) -> tuple[str | None, str | None]:
    """(commit, host id) of a result: the commit None where it was not recorded, ``+dirty``
    appended where the tree had changes; a result from before provenance gets its host id
    from its ``machine`` facts."""
    p = doc.get("provenance") or {}
    commit = p.get("commit")
    if commit and p.get("dirty"):
        commit += "+dirty"
    h = (p.get("host") or {}).get("id")
    if h is None and doc.get("machine"):
        m = doc["machine"]
        h = host_of(m.get("cpu"), m.get("cores"), m.get("memory_bytes"))["id"]
    return commit, h


def describe(doc: dict) -> str:
    """One line for a result's reader: its commit, whether its tree was clean, its host."""
    p = doc.get("provenance") or {}
    commit, h = origin(doc)
    if not commit:
        return f"commit not recorded; host `{h}`"
    changed = p.get("dirty_files") or []
    tree = "a clean tree" if not p.get("dirty") else (
        f"{p.get('dirty_count', len(changed))} files changed: " + ", ".join(changed[:5])
        + (", ..." if p.get("dirty_count", len(changed)) > 5 else ""))
    return f"commit `{p['commit'][:12]}` ({tree}); host `{h}`"


def tag_rows(rows: list[dict]) -> list[dict]:
    """Each row not yet tagged gets this process's origin, ``<commit>@<host id>``, so rows
    pooled from several runs can be told apart (``summary.summarize`` refuses a mix)."""
    state = git_state()
    commit = state["commit"] and state["commit"] + ("+dirty" if state["dirty"] else "")
    here = f"{_short(commit)}@{host()['id']}"
    for r in rows:
        r.setdefault("origin", here)
    return rows


def check(named: Sequence[tuple[str, dict]], across_commits: bool = False, across_hosts: bool = False) -> None:
    """Refuse, in one line, to compare results (name, doc) from different commits or hosts
    unless allowed. An unrecorded commit is never the same as another."""
    seen = [(name, *origin(doc)) for name, doc in named]
    if len(seen) < 2:
        return
    (first, c0, h0), rest = seen[0], seen[1:]
    if not across_commits:
        for name, c, _ in rest:
            if c is None or c0 is None or c != c0:
                raise IncomparableResults(
                    f"{first} (commit {_short(c0)}) and {name} (commit {_short(c)}) ran different or unrecorded "
                    "code; pass --across-commits to compare them anyway")
    if not across_hosts:
        for name, _, h in rest:
            if h != h0:
                raise IncomparableResults(f"{first} (host {h0}) and {name} (host {h}) ran on different hosts; pass "
                                          "--across-hosts to compare them anyway")


def check_rows(rows: Sequence[dict], across_commits: bool = False, across_hosts: bool = False) -> None:
    """``check`` for rows tagged by ``tag_rows`` (untagged rows are taken as one run's)."""
    tags = list(dict.fromkeys(r["origin"] for r in rows if r.get("origin")))
    docs = []
    for tag in tags:
        commit, _, h = tag.rpartition("@")
        docs.append((f"rows from {tag}", {"provenance": {"commit": None if commit == _short(None) else commit,
                                                        "host": {"id": h}}}))
    check(docs, across_commits, across_hosts)


def _short(commit: str | None) -> str:
    return "not recorded" if commit is None else commit[:12] + commit[40:]
