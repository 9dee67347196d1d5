"""The Python half of ``scripts/slurm_check.sh``: a workflow whose workers are Slurm jobs.

    python scripts/slurm_check.py --model tiny-llama --workflow debate --cancel --elastic

1. ``runtime.cluster.slurm_cluster`` starts the scheduler here (KV plugin preloaded) and
   ``scale(jobs=2)`` submits two ``sbatch`` jobs, one worker each (serializers preloaded);
2. the workflow runs in state mode and in text mode: each agent's agreement, and the job and
   host it ran on, are printed;
3. ``--cancel``: state mode again, in a fresh namespace (nothing cached), and the job holding
   the most KV bytes is ``scancel``-led as the second level starts: outputs must still equal
   text mode's (the lost blocks are recomputed from lineage);
4. ``--elastic``: ``adapt`` replaces the cancelled job, ``scale(jobs=1)`` retires one worker
   (its blocks move to the other), and a state-mode rerun still agrees.

Exits 0 only when every agent agreed in every run. ``tests/test_slurm.py`` drives the same
functions.
"""

from __future__ import annotations

import argparse
import inspect
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from distributed import Client

from daskflow_kv.flow.executor import Comparison, WorkflowResult, run_state_mode, run_text_mode
from daskflow_kv.runtime.cluster import slurm_cluster
from daskflow_kv.runtime.kv_runtime import KVRuntime
from daskflow_kv.runtime.slurm import JOB_NAME
from daskflow_kv.workflows import AGENT_PARAM, WORKFLOWS


def say(msg: str) -> None:
    print(f"[slurm-check] {msg}", flush=True)


@dataclass
class Placements:
    """Which Slurm job and host each worker address belongs to, kept after a worker dies."""

    jobs: dict[str, tuple[str, str]] = field(default_factory=dict)  # address -> (job id, host)

    def refresh(self, client: Client) -> dict[str, tuple[str, str]]:
        # Functions the workers can import (this module may be imported, as by the tests, and
        # its own functions would then be pickled by reference).
        jobs, hosts = client.run(os.getenv, "SLURM_JOB_ID", "?"), client.run(socket.gethostname)
        now = {addr: (jobs[addr], hosts[addr]) for addr in jobs}
        self.jobs.update(now)
        return now

    def job(self, address: str) -> str:
        return self.jobs.get(address, ("?", "?"))[0]

    def where(self, address: str) -> str:
        job, host = self.jobs.get(address, ("?", "?"))
        return f"job {job} on {host}"


def squeue() -> str:
    fmt = "%.8i %.20j %.10T %.8M %.4C %.6m %R"
    out = subprocess.run(["squeue", f"--name={JOB_NAME}", "-o", fmt], capture_output=True, text=True)
    return out.stdout.rstrip() or out.stderr.rstrip()


def job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    fields = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return fields.get("JobState", "gone")


def wait_for(pred, timeout: float, what: str, poll: float = 0.5) -> None:
    deadline = time.time() + timeout
    while not pred():
        if time.time() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}\n{squeue()}")
        time.sleep(poll)


def n_workers(client: Client) -> int:
    return len(client.scheduler_info(n_workers=-1)["workers"])


def start(jobs: int, log_directory: str | None, walltime: str, timeout: float = 180):
    """A SLURMCluster with ``jobs`` worker jobs running, and a client on it."""
    cluster = slurm_cluster(walltime=walltime, log_directory=log_directory, allow_loopback=True,
                            scheduler_options={"dashboard_address": ":0"})
    say(f"scheduler {cluster.scheduler_address}, plugins: {', '.join(sorted(cluster.scheduler.plugins))}")
    say("worker job script:\n" + cluster.job_script())
    client = Client(cluster)
    cluster.scale(jobs=jobs)
    client.wait_for_workers(jobs, timeout=timeout)
    return cluster, client


def build(name: str, tokenizer, agents: int, rounds: int, context_tokens: int, max_new_tokens: int):
    build = WORKFLOWS[name]
    kwargs = {AGENT_PARAM[name]: agents, "rounds": rounds, "context_tokens": context_tokens,
              "max_new_tokens": max_new_tokens, "tokenizer": tokenizer}
    params = inspect.signature(build).parameters
    return build(**{k: v for k, v in kwargs.items() if k in params})


def _compiled(wf, rt):
    return wf.compile(rt.tokenizer, rt.facts.max_positions, rt.block_size)


def report(title: str, cmp: Comparison, where: Placements) -> None:
    say(title)
    print(f"  {'agent':<12}{'lvl':>4}  {'state mode ran on':<24}{'text mode ran on':<24}{'tokens':>7}  agree")
    for name, a in cmp.state.agents.items():
        t = cmp.text.agents[name]
        print(f"  {name:<12}{a.level:>4}  {where.where(a.worker):<24}{where.where(t.worker):<24}{len(a.tokens):>7}  "
              f"{'yes' if cmp.agreement[name] else 'NO'}")
    reused = sum(a.tokens_reused for a in cmp.state.agents.values())
    say(f"agreement: {sum(cmp.agreement.values())}/{len(cmp.agreement)} agents identical; state mode prefilled "
        f"{sum(cmp.state.level_tokens_computed)} tokens and reused {reused} from KV blocks "
        f"(text {sum(cmp.text.level_tokens_computed)}); state {cmp.state.wall_s:.1f}s, text {cmp.text.wall_s:.1f}s")


def run_both(rt: KVRuntime, wf, where: Placements) -> Comparison:
    where.refresh(rt.client)
    state = run_state_mode(_compiled(wf, rt), rt)
    text = run_text_mode(_compiled(wf, rt), rt)
    return Comparison(state, text)


@dataclass
class Cancelled:
    """What the mid-workflow ``scancel`` hit and what the scheduler saw afterwards."""

    job: str = ""  # the cancelled Slurm job
    worker: str = ""  # its worker's address
    kv_bytes: int = 0  # KV bytes it held when cancelled
    level: int = -1  # the level that was starting
    at: float = 0.0  # when scancel ran (time.time())
    in_flight: bool = False  # whether the workflow was still running then
    lost: set = field(default_factory=set)  # KV block keys the scheduler reported lost
    recomputed: set = field(default_factory=set)  # block keys recomputed from lineage


def cancel_mid_workflow(rt: KVRuntime, wf, text: WorkflowResult, where: Placements, at_level: int = 1,
                        delay: float | None = None) -> tuple[Comparison, Cancelled]:
    """State mode with the job of the biggest KV holder cancelled as level ``at_level`` starts.

    ``delay`` None: the level starts once the scheduler has removed the worker, so every block
    it held and the level reads must come back from lineage. A number: ``scancel`` runs that
    many seconds into the level, while its tasks are in flight.
    """
    where.refresh(rt.client)
    hit = Cancelled()

    def gone() -> bool:
        return hit.worker not in rt.client.scheduler_info(n_workers=-1)["workers"]

    def progress(mode, level, levels, names):
        if level != at_level or hit.job:
            return
        kv = {a: w.kv_bytes for a, w in rt.view().workers.items()}
        hit.worker = max(kv, key=kv.get)
        hit.job, hit.kv_bytes, hit.level = where.job(hit.worker), kv[hit.worker], level
        say(f"level {level + 1}/{levels} starting: scancel {hit.job}{'' if delay is None else f' in {delay}s'} "
            f"({where.where(hit.worker)}, holding {hit.kv_bytes / 2**20:.2f} MiB of KV)")
        if delay is None:
            scancel()
            wait_for(gone, 60, f"the worker of job {hit.job} to leave", poll=0.1)
        else:
            threading.Timer(delay, scancel).start()

    def scancel():
        hit.at = time.time()
        subprocess.run(["scancel", hit.job], check=True)

    t0 = time.time()
    state = run_state_mode(_compiled(wf, rt), rt, progress=progress)
    hit.in_flight = 0 < hit.at < time.time()
    wait_for(gone, 60, f"the worker of job {hit.job} to leave", poll=0.1)
    events = [m for t, m in rt.client.get_events("daskflow-kv") if t >= t0 and isinstance(m, dict)]
    hit.lost = {m["key"] for m in events if m.get("op") == "lost"}
    hit.recomputed = {m["key"] for m in events if m.get("op") == "recompute" and m.get("reason") == "lineage"}
    return Comparison(state, text), hit


def held_blocks(rt: KVRuntime) -> dict[str, set[str]]:
    """KV block key -> the workers holding it, from the scheduler plugin's catalog."""
    return {r["block_key"]: set(r["workers"].split(",")) for r in rt.catalog().to_pylist() if r["workers"]}


def _by_job(blocks: dict[str, set[str]], where: Placements) -> str:
    count: dict[str, int] = {}
    for ws in blocks.values():
        for w in ws:
            count[where.job(w)] = count.get(where.job(w), 0) + 1
    return ", ".join(f"job {j}: {n}" for j, n in sorted(count.items()))


def elastic(cluster, client: Client, model: str, wf, text: WorkflowResult, where: Placements,
            timeout: float = 180) -> list[Comparison]:
    """adapt to 2 jobs (replacing a lost one) and run; scale down to 1 and run again: the
    retired worker's KV blocks must have moved to the survivor and be reused."""
    runs = []
    adaptive = cluster.adapt(minimum_jobs=2, maximum_jobs=2)
    wait_for(lambda: n_workers(client) == 2, timeout, "adapt to bring 2 workers")
    say(f"adapt(minimum_jobs=2, maximum_jobs=2): 2 workers\n{squeue()}")
    rt = KVRuntime(client, model, namespace="slurm-elastic")  # a fresh cache, spread over both jobs
    cmp = Comparison(run_state_mode(_compiled(wf, rt), rt), text)
    where.refresh(client)
    report("state mode after adapt, vs text mode", cmp, where)
    runs.append(cmp)

    adaptive.stop()  # scale() sets the size from here
    before = held_blocks(rt)
    cluster.scale(jobs=1)
    wait_for(lambda: n_workers(client) == 1, timeout, "scale(jobs=1) to retire a worker")
    say(f"scale(jobs=1): 1 worker\n{squeue()}")
    after = held_blocks(rt)
    say(f"KV blocks held before scale-down: {len(before)} ({_by_job(before, where)}); after: {len(after)} "
        f"({_by_job(after, where)}); none lost: {set(before) <= set(after)}")
    cmp = Comparison(run_state_mode(_compiled(wf, rt), rt), text)
    report("state mode after scale-down, vs text mode", cmp, where)
    runs.append(cmp)
    return runs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--workflow", default="debate", choices=sorted(WORKFLOWS))
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--context-tokens", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--walltime", default="00:20:00")
    p.add_argument("--log-directory", default=None, help="where worker jobs write their stdout/stderr")
    p.add_argument("--cancel", action="store_true", help="scancel a worker job mid-workflow")
    p.add_argument("--cancel-delay", type=float, default=None,
                   help="scancel this many seconds into the level (tasks in flight) instead of before it runs")
    p.add_argument("--elastic", action="store_true", help="adapt and scale down, rerunning after each")
    args = p.parse_args(argv)

    t0 = time.time()
    cluster, client = start(args.jobs, args.log_directory, args.walltime)
    runs: list[tuple[str, Comparison]] = []
    try:
        where = Placements()
        say(f"{n_workers(client)} workers up in {time.time() - t0:.1f}s:")
        for addr, (job, host) in sorted(where.refresh(client).items()):
            print(f"  {addr}  job {job} on {host}")
        print(squeue())
        rt = KVRuntime(client, args.model)
        rt.calibrate()
        wf = build(args.workflow, rt.tokenizer, args.agents, args.rounds, args.context_tokens, args.max_new_tokens)
        say(f"{args.workflow} on {args.model}: {len(wf.agents)} agents; state mode, then text mode")
        cmp = run_both(rt, wf, where)
        report(f"{args.workflow} on {args.model}: state vs text mode", cmp, where)
        runs.append(("both modes", cmp))

        if args.cancel:
            rt2 = KVRuntime(client, args.model, namespace="slurm-cancel")  # nothing cached: every block is new
            cmp2, hit = cancel_mid_workflow(rt2, wf, cmp.text, where, delay=args.cancel_delay)
            wait_for(lambda: job_state(hit.job) != "RUNNING", 60, f"job {hit.job} to end")
            report(f"state mode with job {hit.job} cancelled at level {hit.level + 1}, vs text mode", cmp2, where)
            say(f"job {hit.job}: {job_state(hit.job)}, cancelled while the workflow ran: {hit.in_flight}; "
                f"{len(hit.lost)} KV blocks lost, "
                f"{len(hit.recomputed)} recomputed from lineage; workers now {n_workers(client)}")
            if not any(where.job(a.worker) == hit.job for a in cmp2.state.agents.values()):
                say(f"no agent's decode ran on job {hit.job} (it was cancelled before any did)")
            runs.append((f"job {hit.job} cancelled", cmp2))
        if args.elastic:
            for i, c in enumerate(elastic(cluster, client, args.model, wf, cmp.text, where)):
                runs.append((["after adapt", "after scale-down"][i], c))
        say("worker jobs seen: " + ", ".join(sorted({j for j, _ in where.jobs.values()}, key=int)))
    finally:
        client.close()
        cluster.close()
        say(f"cluster closed; jobs left:\n{squeue()}")

    ok = all(c.all_agree for _, c in runs)
    for label, c in runs:
        say(f"{args.model} {args.workflow} {label}: {sum(c.agreement.values())}/{len(c.agreement)} agents agree")
    say(f"{'ALL AGREE' if ok else 'DISAGREEMENT'} in {time.time() - t0:.0f}s")
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
