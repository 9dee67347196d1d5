"""Real bandwidth limits for exp 3: two Dask workers in two network namespaces joined by a
veth pair whose both ends are rate-limited with ``tc`` (token bucket filter).

Layout (all made and removed here, nothing in the host's own namespace changes)::

    netns A: worker A (10.R.0.1)  <-- veth, tbf rate X on both ends -->  netns B: worker B,
                                                                        scheduler + client (10.R.0.2)

The parent process creates the namespaces and runs ``python -m daskflow_kv.bench.netem child``
inside namespace B (``ip netns exec``). The child starts a scheduler with the KV plugin
(``runtime.cluster.local_cluster(n_workers=0)``), starts worker A with ``ip netns exec A dask
worker`` and worker B locally, calibrates prefill once (up to the longest context), and for
each (rate, contexts) job: sets the rate, re-measures both links (so the cost model sees the
throttled link) and runs ``experiments.transfer_vs_recompute_point`` A -> B for each of the
job's contexts. Needs root, ``ip`` and ``tc``; ``netns_status`` says why not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

from . import provenance


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def netns_status() -> tuple[bool, str]:
    """(usable, why not): root, ip and tc present, and a namespace can actually be made."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "not a POSIX system"
    if os.geteuid() != 0:
        return False, "needs root for ip netns / tc"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"{tool} not found"
    probe = f"dfkvprobe{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return False, f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return True, ""


class VethPair:
    """Two namespaces joined by a veth pair; ``set_rate`` shapes both directions."""

    def __init__(self, tag: str | None = None):
        tag = tag or f"{os.getpid() % 100000}"
        self.ns_a, self.ns_b = f"dfkvA{tag}", f"dfkvB{tag}"
        self.dev_a, self.dev_b = f"dfkva{tag}"[:15], f"dfkvb{tag}"[:15]
        octet = 16 + os.getpid() % 200  # a /24 of our own, inside our own namespaces only
        self.ip_a, self.ip_b = f"10.{octet}.77.1", f"10.{octet}.77.2"

    def __enter__(self) -> Self:
        try:
            _ip("netns", "add", self.ns_a)
            _ip("netns", "add", self.ns_b)
            _ip("link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
            _ip("link", "set", self.dev_a, "netns", self.ns_a)
            _ip("link", "set", self.dev_b, "netns", self.ns_b)
            for ns, dev, ip in ((self.ns_a, self.dev_a, self.ip_a), (self.ns_b, self.dev_b, self.ip_b)):
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:  # processes this benchmark started inside its own namespaces
                try:
                    os.kill(int(pid), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
            if pids:
                time.sleep(1.0)
                for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, ValueError):
                        pass
            _ip("netns", "del", ns, check=False)


def set_rate(ns: str, dev: str, mbit: float | None) -> None:
    """tbf at ``mbit`` Mbit/s on ``dev`` in ``ns`` (None: remove the limit)."""
    base = ["ip", "netns", "exec", ns, "tc", "qdisc"]
    subprocess.run([*base, "del", "dev", dev, "root"], capture_output=True, check=False)  # may have none
    if mbit is None:
        return
    rate_bytes = mbit * 1e6 / 8
    burst = max(64 * 1024, int(rate_bytes / 100))  # 10 ms of traffic
    subprocess.run([*base, "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
                    "latency", "200ms"], check=True, capture_output=True, text=True)


# -- parent side ------------------------------------------------------------------------------------
def run_throttled(model: str, jobs: list[tuple[float | None, list[int]]], dtype: str = "float32",
                  timeout: float = 3600, runtime_decision: bool = True, memory_limit: str = "8GiB") -> dict:
    """Run the throttled exp 3 in fresh namespaces: for each (rate in Mbit/s or None, contexts)
    job, in order. {"rows": [...]} or {"error": why}."""
    ok, why = netns_status()
    if not ok:
        return {"error": why, "rows": []}
    out = Path(f"/tmp/daskflow-bench-netem-{os.getpid()}.json")
    with VethPair() as pair:
        cmd = ["ip", "netns", "exec", pair.ns_b, sys.executable, "-m", "daskflow_kv.bench.netem", "child",
               "--ns-a", pair.ns_a, "--ns-b", pair.ns_b, "--dev-a", pair.dev_a, "--dev-b", pair.dev_b,
               "--ip-a", pair.ip_a, "--ip-b", pair.ip_b, "--model", model, "--dtype", dtype,
               "--memory-limit", memory_limit, "--out", str(out),
               "--jobs", *[f"{'none' if r is None else r}:{','.join(map(str, cs))}" for r, cs in jobs]]
        if not runtime_decision:
            cmd.append("--no-runtime-decision")
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
            rc = "timeout"
    if not out.exists():
        return {"error": f"throttled run produced no result (exit {rc})", "rows": []}
    doc = json.loads(out.read_text())
    out.unlink()
    if rc != 0:
        doc["error"] = f"child exit {rc}"
    return doc


# -- child side (inside namespace B) ----------------------------------------------------------------
def _job(text: str) -> tuple[float | None, list[int]]:
    rate, _, contexts = text.partition(":")
    return (None if rate == "none" else float(rate)), [int(c) for c in contexts.split(",") if c]


def _measure_links(rt, workers: list[str], probe: int) -> dict[str, float]:
    """Both directions' latency and bandwidth, recorded with the plugin as calibration does
    (the prefill profiles are left as they are: the link changed, the workers did not)."""
    out = {}
    for src, dst in ((workers[0], workers[1]), (workers[1], workers[0])):
        out[f"{src}->{dst}"] = rt.calibrator.record_link(src, dst, probe).bandwidth
    return out



def _start_worker(scheduler: str, host: str, name: str, memory_limit: str, ns: str | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "distributed.cli.dask_worker", scheduler, "--nthreads", "1", "--nworkers", "1",
           "--memory-limit", memory_limit, "--preload", "daskflow_kv.transport.serialization", "--host", host,
           "--no-dashboard", "--name", name]
    if ns:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def child(args) -> int:
    import logging

    from distributed import Client

    from ..runtime.cluster import local_cluster
    from ..runtime.kv_runtime import KVRuntime
    from . import experiments as E
    from . import systems as S
    from .common import log

    logging.getLogger("daskflow_kv.scheduler").setLevel(logging.ERROR)  # drains log "over budget"
    rows: list[dict] = []
    procs: list[subprocess.Popen] = []
    doc = {"rows": rows, "ip_a": args.ip_a, "ip_b": args.ip_b}
    cluster = local_cluster(n_workers=0, host=args.ip_b, dashboard_address=None)
    try:
        addr = cluster.scheduler_address
        procs.append(_start_worker(addr, args.ip_a, "netem-A", args.memory_limit, args.ns_a))
        procs.append(_start_worker(addr, args.ip_b, "netem-B", args.memory_limit, None))
        with Client(cluster) as client:
            client.wait_for_workers(2, timeout=120)
            ws = S.workers_of(client)
            src = next(w for w in ws if args.ip_a in w)
            dst = next(w for w in ws if args.ip_b in w)
            rt = KVRuntime(client, args.model, dtype=args.dtype)
            S.shorten_lease(client)
            jobs = [_job(j) for j in args.jobs]
            longest = max(n for _, cs in jobs for n in cs)
            t0 = time.perf_counter()
            # prefill speed does not depend on the link: measured once, over the lengths predicted
            rt.calibrate(probe_bytes=8 << 20, probe_tokens=min(longest, rt.facts.max_positions - 16))
            log(f"  netem: calibrated prefill up to {longest} tokens in {time.perf_counter() - t0:.1f}s")
            for mbit, contexts in jobs:
                set_rate(args.ns_a, args.dev_a, mbit)
                set_rate(args.ns_b, args.dev_b, mbit)
                probe = 32 << 20 if mbit is None else int(min(32 << 20, max(1 << 20, mbit * 1e6 / 8 * 1.0)))
                t0 = time.perf_counter()
                bw = _measure_links(rt, [src, dst], probe)
                label = "none" if mbit is None else f"{mbit:g}"
                log(f"  netem {label} Mbit/s: links measured in {time.perf_counter() - t0:.1f}s "
                    f"({', '.join(f'{v / 1e6:.1f} MB/s' for v in bw.values())})")
                for n in contexts:
                    n = min(n, rt.facts.max_positions - 16)
                    row = E.transfer_vs_recompute_point(rt, src, dst, n, seed=n + int(mbit or 0),
                                                        runtime_decision=args.runtime_decision,
                                                        label=f"netem {label} Mbit/s",
                                                        probe_bandwidth=bw.get(f"{src}->{dst}"))
                    row["rate_mbit"] = mbit
                    rows.append(row)
                    log(f"    {n} tok {row['kv_bytes'] / 2**20:.1f} MiB: transfer {row['transfer_s']:.3f}s "
                        f"({row['transfer_gbps'] * 8000:.0f} Mbit/s) recompute {row['recompute_s']:.3f}s; "
                        f"model {row['model_action']} (probe bw: {row.get('probe_model_action')}) "
                        f"runtime {row.get('runtime_action')} faster {row['faster']}")
                    Path(args.out).write_text(json.dumps(provenance.stamp(doc), default=str))
    except Exception as e:  # noqa: BLE001 -- report what was measured, with the reason it stopped
        doc["error"] = f"{type(e).__name__}: {e}"
        log(f"  netem child failed: {doc['error']}")
    finally:
        Path(args.out).write_text(json.dumps(provenance.stamp(doc), default=str))
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        cluster.close()
    return 0 if "error" not in doc else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="exp 3 under real rate limits (see module doc)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("child")
    for a in ("--ns-a", "--ns-b", "--dev-a", "--dev-b", "--ip-a", "--ip-b", "--out"):
        c.add_argument(a, required=True)
    c.add_argument("--model", default="tiny-llama")
    c.add_argument("--dtype", default="float32")
    c.add_argument("--memory-limit", default="8GiB")
    c.add_argument("--jobs", nargs="+", default=["none:256"], help="RATE:CTX,CTX... (RATE in Mbit/s or none)")
    c.add_argument("--no-runtime-decision", dest="runtime_decision", action="store_false")
    args = ap.parse_args(argv)
    return child(args)


if __name__ == "__main__":
    sys.exit(main())
