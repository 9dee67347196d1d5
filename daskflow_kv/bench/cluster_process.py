"""A LocalCluster in a process of its own: scheduler in that process, workers under nannies.

Scenarios use it where the client's process must not be the scheduler's: to SIGKILL the
scheduler as a crash would (scheduler_lost), or to read the scheduler's memory apart from
the clients' (the soak: in one process, their growths cannot be told apart).

    python -m daskflow_kv.bench.cluster_process WORKERS   # prints "address tcp://..." then serves
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def start(workers: int, log=print) -> tuple[subprocess.Popen, str]:
    """The cluster's process and its scheduler's address, once it listens."""
    proc = subprocess.Popen([sys.executable, "-m", "daskflow_kv.bench.cluster_process", str(workers)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    line = proc.stdout.readline().strip()
    if not line.startswith("address "):
        proc.kill()
        raise RuntimeError(f"the cluster process did not start: {line!r}")
    log(f"cluster up at {line.split()[1]} (pid {proc.pid})")
    return proc, line.split()[1]


def end(proc: subprocess.Popen) -> None:
    """The cluster process and what it left behind (orphaned workers), gone."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _serve(workers: int) -> None:
    from ..runtime.cluster import local_cluster

    with local_cluster(workers, 1, dashboard_address=None) as cluster:
        print(f"address {cluster.scheduler_address}", flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].isdigit():
        _serve(int(sys.argv[1]))
    else:
        sys.exit("usage: python -m daskflow_kv.bench.cluster_process WORKERS")
