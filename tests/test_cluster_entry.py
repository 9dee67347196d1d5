"""Cluster entry points: `dask scheduler --preload`, connect(), SLURM recipe, CUDA cluster."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from daskflow_kv.runtime import cluster as kvc


def _dask_cli() -> list[str]:
    exe = Path(sys.executable).with_name("dask")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "dask"]


def _spawn(args, log):
    # Own process group: the whole tree (a worker's nanny and its child) is killed at once.
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _kill(proc):
    if proc.poll() is None:
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(wait)
                return
            except subprocess.TimeoutExpired:
                continue


def test_dask_scheduler_preload_loads_the_plugin(tmp_path):
    from daskflow_kv.runtime.kv_runtime import KVRuntime

    sched_file = tmp_path / "scheduler.json"
    log = open(tmp_path / "log.txt", "w")  # noqa: SIM115 -- the subprocesses write to it until killed
    procs = []
    try:
        procs.append(_spawn([*_dask_cli(), "scheduler", "--host", "127.0.0.1", "--port", "0",
                             "--no-dashboard", "--scheduler-file", str(sched_file),
                             "--preload", kvc.SCHEDULER_PRELOAD, "--kv-budget", "3MiB"], log))
        # The worker starts alongside (it waits for the scheduler file), so both import at once.
        procs.append(_spawn([*_dask_cli(), "worker", "--scheduler-file", str(sched_file), "--nthreads", "1",
                             "--no-nanny", "--no-dashboard", "--memory-limit", "2GiB",
                             "--preload", kvc.WORKER_PRELOAD], log))
        deadline, address = time.time() + 60, None
        while address is None and time.time() < deadline:
            assert procs[0].poll() is None, (tmp_path / "log.txt").read_text()
            try:  # Dask writes the file in place: it can exist and still be empty or half-written
                address = json.loads(sched_file.read_text())["address"]
            except (FileNotFoundError, ValueError):
                time.sleep(0.1)
        assert address, "no scheduler file within 60 s: " + (tmp_path / "log.txt").read_text()
        client = kvc.connect(address, timeout="30s")  # registers the plugin again: must keep the preloaded one
        try:
            client.wait_for_workers(1, timeout=60)

            def info(dask_scheduler):
                p = dask_scheduler.plugins["daskflow-kv"]
                amm = dask_scheduler.extensions["amm"]
                return type(p).__name__, p.kv_budget_bytes, sorted(type(x).__name__ for x in amm.policies)

            name, budget, policies = client.run_on_scheduler(info)
            assert name == "KVSchedulerPlugin" and budget == 3 * 2**20  # from --kv-budget
            assert "KVAwareReduceReplicas" in policies and "ReduceReplicas" not in policies
            assert all(client.run(lambda: "daskflow_kv.transport.serialization" in sys.modules).values())
            rt = KVRuntime(client, "tiny-llama", block_size=16)  # end to end through the preloaded plugin
            s = rt.materialize(rt.encode("A preloaded scheduler serves KV states."))
            assert rt.counters()["kv_budget_bytes"] == 3 * 2**20
            g = rt.resume(s, rt.encode(" Yes?"), max_new_tokens=2)
            assert len(g.tokens) == 2 and rt.catalog().num_rows >= len(s.state.blocks)
        finally:
            client.close()
    finally:
        for p in reversed(procs):
            _kill(p)
        log.close()
    assert all(p.poll() is not None for p in procs)


def test_scheduler_command_names_the_preload():
    cmd = kvc.scheduler_command(kv_budget="2GiB", port=8786)
    assert cmd == (
        "dask scheduler --port 8786 --preload daskflow_kv.plugins.kv_scheduler --kv-budget 2GiB"
        " --preload daskflow_kv.plugins.dashboard"
    )


def test_amm_config_names_an_importable_policy():
    from distributed.utils import import_term

    [policy] = kvc.kv_dask_config()["distributed.scheduler.active-memory-manager.policies"]
    from daskflow_kv.plugins.kv_scheduler import KVAwareReduceReplicas

    assert import_term(policy["class"]) is KVAwareReduceReplicas


def test_slurm_job_script_renders_worker_with_preload():
    pytest.importorskip("dask_jobqueue")
    script = kvc.render_slurm_job_script(
        "tcp://10.1.2.3:8786", cores=4, memory="16GiB", walltime="00:30:00", queue="gpu",
        job_script_prologue=["source /opt/venv/bin/activate"],
    )
    assert script.startswith("#!/usr/bin/env bash")
    for line in ("#SBATCH -p gpu", "#SBATCH --cpus-per-task=4", "#SBATCH -t 00:30:00",
                 "source /opt/venv/bin/activate"):
        assert line in script
    [cmd] = [ln for ln in script.splitlines() if "distributed.cli.dask_worker" in ln]
    assert "tcp://10.1.2.3:8786" in cmd and "--nthreads 4" in cmd
    assert f"--preload {kvc.WORKER_PRELOAD}" in cmd
    assert f"--preload-nanny {kvc.NANNY_PRELOAD}" in cmd  # tests/test_nanny_env.py: what it does
    assert cmd.startswith(sys.executable)  # the client's Python (a venv's bin/python)
    assert "--lifetime 1680s --lifetime-stagger 60s" in cmd  # retires 2m (+-1m) before the 30m walltime


def test_slurm_job_script_defaults_come_from_config_and_forward_the_environment():
    pytest.importorskip("dask_jobqueue")
    import dask

    with dask.config.set({"daskflow-kv.cluster.memory-limit": "3GiB", "daskflow-kv.cluster.threads-per-worker": 2}):
        script = kvc.render_slurm_job_script("tcp://10.1.2.3:8786", processes=2, walltime="01:00:00",
                                             env={"PYTHONPATH": "/src/my repo", "DASKFLOW_KV_CACHE": "/scratch/kv"})
    assert "#SBATCH --cpus-per-task=4" in script and "#SBATCH --mem=6G" in script
    assert "#SBATCH -J daskflow-kv-worker" in script
    lines = script.splitlines()
    exports = [ln for ln in lines if ln.startswith("export ")]
    assert sorted(exports) == ["export DASKFLOW_KV_CACHE=/scratch/kv", "export PYTHONPATH='/src/my repo'"]
    assert lines.index(exports[-1]) < next(i for i, ln in enumerate(lines) if "dask_worker" in ln)


def test_slurm_kv_budget_must_fit_in_a_worker():
    pytest.importorskip("dask_jobqueue")
    with pytest.raises(ValueError, match="does not fit"):
        kvc.render_slurm_job_script(kv_budget="4GiB", memory="8GiB", processes=2)
    kvc.render_slurm_job_script(kv_budget="3GiB", memory="8GiB", processes=2)


def test_slurm_helpers():
    from daskflow_kv.runtime.slurm import forwarded_env, is_loopback, job_workers, walltime_seconds, worker_lifetime

    assert [walltime_seconds(w) for w in ("30", "30:15", "01:00:00", "2-0", "1-02:03", "1-02:03:04", 90)] == [
        1800, 1815, 3600, 172800, 93780, 93784, 5400]
    assert walltime_seconds(None) is None and worker_lifetime(None, 120) is None
    assert worker_lifetime(3600, 120) == 3480 and worker_lifetime(120, 120) == 60  # at least half the walltime
    env = {"PYTHONPATH": "/x", "DASKFLOW_KV_CACHE": "/c", "DASK_DASKFLOW_KV__KV_BUDGET": "1GiB", "HOME": "/root"}
    assert forwarded_env(env) == {k: v for k, v in env.items() if k != "HOME"}
    assert job_workers(["C-1"], ["C-1", "C-10", "C-2"]) == ["C-1"]
    assert job_workers(["C-1"], ["C-1-0", "C-1-1", "C-10-0"]) == ["C-1-0", "C-1-1"]
    assert is_loopback("tcp://127.0.0.1:8786") and not is_loopback("tcp://10.0.0.5:8786")


def test_slurm_cluster_preloads_the_plugin_on_its_scheduler():
    pytest.importorskip("dask_jobqueue")
    cluster = kvc.slurm_cluster(kv_budget="1GiB", cores=2, memory="4GiB", walltime="00:10:00",
                                scheduler_options={"dashboard_address": ":0"})
    try:
        plugin = cluster.scheduler.plugins["daskflow-kv"]
        assert plugin.kv_budget_bytes == 2**30
        script = cluster.job_script()
        assert cluster.scheduler_address in script and f"--preload {kvc.WORKER_PRELOAD}" in script
    finally:
        cluster.close()


def test_cuda_cluster_says_what_is_missing():
    from daskflow_kv.runtime.cuda import gpu_count

    has_cuda_stack = gpu_count() > 0 and shutil.which("nvidia-smi") is not None
    try:
        import dask_cuda  # noqa: F401
    except ImportError:
        has_cuda_stack = False
    if has_cuda_stack:
        pytest.skip("a GPU and dask-cuda are present; the GPU test suite covers cuda_cluster")
    with pytest.raises(RuntimeError, match="dask-cuda|GPU"):
        kvc.cuda_cluster()


def test_slurm_cluster_over_tls_puts_the_certificates_in_the_job_script():
    pytest.importorskip("dask_jobqueue")
    pytest.importorskip("cryptography")
    from distributed import Security

    cluster = kvc.slurm_cluster(security=Security.temporary(), cores=1, memory="2GiB", allow_loopback=True,
                                scheduler_options={"dashboard_address": ":0"})
    try:
        assert cluster.scheduler_address.startswith("tls://")
        script = cluster.job_script()
        assert "--protocol tls://" in script and "--tls-ca-file" in script and "--tls-key" in script
    finally:
        cluster.close()
