"""Everything of the GPU path that runs without a GPU: frame counting, the result file, the UCX
log reader, worker/device slots, the 1B-shape model recipe, the check's scripts and extras.

The GPU halves (blocks over UCX, the measurement) are tests/test_gpu_ucx.py and
scripts/gpu_check.sh; here they must skip cleanly.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch

from daskflow_kv.bench import gpu_check, gpu_report as gr
from daskflow_kv.transport import frame_counts as fc
from daskflow_kv.runtime.cuda import cuda_cluster, next_slot, worker_devices
from daskflow_kv.transport.serialization import deserialize_torch_tensor, serialize_torch_tensor

ROOT = Path(__file__).resolve().parents[1]


class _DeviceBuffer:
    """Stands in for an RMM DeviceBuffer / CuPy array: all that marks device memory."""

    __cuda_array_interface__ = {"shape": (4,), "typestr": "|u1", "data": (0, False), "version": 3}


# -- frame counts ------------------------------------------------------------------------------
def test_frame_kind_and_counting_rules():
    assert fc.frame_kind(_DeviceBuffer()) == fc.DEVICE
    assert fc.frame_kind(memoryview(b"abc")) == fc.HOST and fc.frame_kind(bytearray(3)) == fc.HOST
    c = fc.FrameCounts()
    c.record_sent(fc.DEVICE, 100)
    c.record_received(fc.DEVICE, 100)
    snap = c.snapshot()
    assert snap["device_sent"] == snap["device_received"] == 1 and snap["device_sent_bytes"] == 100
    assert not fc.host_path_taken(snap)
    c.record_sent(fc.HOST, 8)
    assert fc.host_path_taken(c.snapshot()) and c.snapshot()["host_staged_sent_bytes"] == 8
    c.reset()
    assert set(c.snapshot().values()) == {0}
    c.record_received(fc.HOST, 5)
    assert fc.host_path_taken(c.snapshot())


def test_total_and_delta_over_workers():
    z = dict.fromkeys(fc.FIELDS, 0)
    before = {"a": {**z, "device_sent": 1}, "b": z}
    after = {"a": {**z, "device_sent": 3}, "b": {**z, "device_received": 2, "host_received": 1}}
    d = fc.delta(after, before)
    assert d["a"]["device_sent"] == 2 and d["b"]["device_received"] == 2
    t = fc.total(d)
    assert t["device_sent"] == 2 and t["device_received"] == 2 and fc.host_path_taken(t)


def test_serializers_count_cuda_tensors_that_cross_as_host_bytes():
    """The "dask" family is the host path: a CUDA tensor arriving through it is counted (here
    simulated: a header that says cuda on a machine without CUDA); host tensors are not."""
    fc.reset()
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    header, frames = serialize_torch_tensor(t)
    assert not fc.host_path_taken(fc.snapshot())  # CPU tensors are none of its business
    u = deserialize_torch_tensor({**header, "device": "cuda"}, frames)
    snap = fc.snapshot()
    assert snap["host_received"] == 1 and snap["host_received_bytes"] == t.nbytes and fc.host_path_taken(snap)
    assert torch.equal(u.cpu(), t)
    fc.reset()


# -- the result file and verdicts ----------------------------------------------------------------
def test_report_is_valid_json_after_every_step(tmp_path):
    out = tmp_path / "sub" / "gpu.json"
    rep = gr.GpuReport(out, "gpu_check --reps 1")
    rep.save()
    doc = json.loads(out.read_text())
    for field in ("protocol", "agree", "transfer_gbps", "cupy_gbps", "host_staging", "timings"):
        assert field in doc
    rep.phase("transfer", 1.5, transfer_gbps=float("nan"), cupy_gbps=12.0, transfer=[{"gbps": math.inf}])
    rep.error("workflow", RuntimeError("boom"))
    doc = json.loads(out.read_text())  # NaN/inf written as null: strict JSON
    assert doc["transfer_gbps"] is None and doc["cupy_gbps"] == 12.0 and doc["transfer"][0]["gbps"] is None
    assert doc["timings"]["phases"]["transfer"] == 1.5
    assert doc["errors"] == [{"phase": "workflow", "error": "RuntimeError: boom"}]
    assert not list(out.parent.glob("*.tmp"))


def test_agreement_and_headline_figures():
    assert gr.all_agree({}) is None
    assert gr.all_agree({"x": {"a": True, "b": True}, "y": {"c": True}}) is True
    assert gr.all_agree({"x": {"a": True}, "y": {"c": False}}) is False
    rows = [{"kind": "kv-tensor", "protocol": "ucx", "size_mib": 64, "gbps": 1.0},
            {"kind": "kv-tensor", "protocol": "ucx", "size_mib": 1024, "gbps": 9.0},
            {"kind": "kv-tensor", "protocol": "ucx", "size_mib": 1024, "gbps": 11.0},
            {"kind": "kv-tensor", "protocol": "ucx", "size_mib": 1024, "gbps": 10.0},
            {"kind": "cupy", "protocol": "ucx", "size_mib": 1024, "gbps": 10.5},
            {"kind": "kv-tensor", "protocol": "tcp", "size_mib": 1024, "gbps": 2.0}]
    assert gr.headline_gbps(rows, "kv-tensor", "ucx") == 10.0  # median at the largest size
    assert gr.headline_gbps(rows, "kv-tensor", "ucx", 64) == 1.0
    assert gr.headline_gbps(rows, "kv-tensor", "tcp") == 2.0
    assert math.isnan(gr.headline_gbps(rows, "cupy", "tcp"))


def test_host_staging_verdict():
    z = dict.fromkeys(fc.FIELDS, 0)
    clean = {**z, "device_sent": 4, "device_received": 4}
    assert gr.host_staging(None, None) is None
    assert gr.host_staging(z, None) is None  # nothing arrived: nothing proven
    assert gr.host_staging(clean, None) is False
    assert gr.host_staging({**clean, "host_staged_sent": 1}, None) is True
    assert gr.host_staging(clean, {"cuda_tables": 2, "cuda_ipc_large": True}) is False
    assert gr.host_staging(clean, {"cuda_tables": 2, "cuda_ipc_large": False}) is True  # UCX staged it
    assert gr.verdict({"agree": True, "cupy_ratio": 0.95, "host_staging": False}) == {
        "agree": True, "cupy_ratio_ge_0.9": True, "no_host_staging": True}
    assert gr.verdict({"agree": None, "cupy_ratio": 0.5, "host_staging": None})["cupy_ratio_ge_0.9"] is False


# UCX_PROTO_INFO tables as proto_debug.c prints them, each line behind the log prefix.
_PREFIX = "[1764500000.123456] [h200:4242 :0]"
_UCX_LOG = "\n".join(f"{_PREFIX} {line}" for line in [
    "+--------------------------------+----------------------------------------------------+",
    "| ucp_context_0 intra-node cfg#2 | tagged message by ucp_tag_send* from cuda/GPU0     |",
    "+--------------------------------+------------------------------------+---------------+",
    "|                        0..8184 | eager copy-in copy-out             | cuda_copy/cuda |",
    "|                      8185..inf | (?) rendezvous zero-copy read from remote | cuda_ipc/cuda |",
    "+--------------------------------+------------------------------------+---------------+",
    "| ucp_context_0 intra-node cfg#2 | tagged message by ucp_tag_send* from host memory   |",
    "+--------------------------------+------------------------------------+---------------+",
    "|                          0..inf | eager short                        | posix/memory  |",
    "+--------------------------------+------------------------------------+---------------+",
])
_UCX_STAGED = _UCX_LOG.replace("(?) rendezvous zero-copy read from remote | cuda_ipc/cuda",
                               "rendezvous pipeline cuda_copy | cuda_copy/cuda, tcp/lo")


def test_ucx_protocol_tables(tmp_path):
    p = gr.parse_ucx_proto(_UCX_LOG)
    assert p["tables"] == 2 and p["cuda_tables"] == 1
    assert p["cuda_transports"] == ["cuda_copy", "cuda_ipc"] and p["cuda_ipc_large"] is True
    s = gr.parse_ucx_proto(_UCX_STAGED)
    assert s["cuda_ipc_large"] is False and "tcp" in s["cuda_transports"]
    assert gr.parse_ucx_proto("no tables here\n| a | b | c |")["cuda_tables"] == 0
    (tmp_path / "ucx.1.log").write_text(_UCX_LOG)
    (tmp_path / "ucx.2.log").write_text("")
    logs = gr.read_ucx_logs(tmp_path)
    assert logs["log_files"] == 2 and logs["cuda_ipc_large"]
    assert gr.read_ucx_logs(tmp_path / "missing") is None and gr.read_ucx_logs(None) is None


# -- the driver's arguments and its skip ----------------------------------------------------------
def test_driver_arguments():
    a = gpu_check.parse_args([])
    assert a.phases == list(gpu_check.PHASES) and a.sizes_mib == [64, 256, 1024] and a.out.name == "gpu_h200.json"
    a = gpu_check.parse_args(["--phases", "env, transfer", "--sizes-mib", "8,16", "--reps", "1", "--devices", "0,0"])
    assert a.phases == ["env", "transfer"] and a.sizes_mib == [8, 16] and a.devices == "0,0"
    for bad in (["--phases", "env,warp"], ["--sizes-mib", "0"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            gpu_check.parse_args(bad)
    shape = gpu_check._kv_shape(64 << 20)
    assert shape[:3] == (16, 2, 8) and 2 * math.prod(shape) == 64 << 20  # 1B geometry, bf16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_driver_skips_without_cuda_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    assert gpu_check.SKIP_MESSAGE in capsys.readouterr().out
    assert not out.exists()


def test_on_device_sees_host_tensors():
    got = gpu_check.on_device(torch.zeros(4), torch.zeros(2, dtype=torch.bfloat16))
    assert got == {"bytes": 20, "all_on_device": False, "kinds": ["torch.cpu"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_script_skips_with_a_clear_message():
    result = ROOT / "benchmarks" / "results" / "gpu_h200.json"
    before = result.read_bytes() if result.exists() else None
    env = {**os.environ, "PYTHON": sys.executable}
    run = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("SKIP gpu_check: no CUDA device")
    assert (result.read_bytes() if result.exists() else None) == before


def test_gpu_check_script_passes_arguments_through():
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DRY_RUN": "1", "GPU_CHECK_BUDGET": "200"}
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--reps", "1", "--phases", "env,tcp"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    driver = [ln for ln in run.stdout.splitlines() if "daskflow_kv.bench.gpu_check" in ln]
    assert len(driver) == 1 and driver[0].startswith("DRY-RUN: timeout")
    assert "--budget 200" in driver[0] and driver[0].endswith("--reps 1 --phases env,tcp")
    assert any("pytest -q -m gpu" in ln and "tests/test_gpu_ucx.py" in ln for ln in run.stdout.splitlines())


# -- workers on devices ------------------------------------------------------------------------
def test_worker_devices():
    assert worker_devices(None, 1) == ["0", "0"]  # one GPU: two workers share it
    assert worker_devices(None, 4) == ["0", "1", "2", "3"]
    assert worker_devices("0,0", 1) == ["0", "0"] and worker_devices([1, 1, 0], 2) == ["1", "1", "0"]
    assert worker_devices(None, 2, n_workers=3) == ["0", "1", "0"]
    assert worker_devices("0,1", 2, n_workers=1) == ["0"]
    with pytest.raises(ValueError):
        worker_devices(None, 0)
    with pytest.raises(ValueError):
        worker_devices("0", 1, n_workers=0)


def test_next_slot_names_workers_by_slot():
    assert next_slot({}, 2) == 0 and next_slot({0: "spec"}, 2) == 1 and next_slot({1: "spec"}, 2) == 0
    with pytest.raises(ValueError, match="Can not scale beyond"):
        next_slot({0: "a", 1: "b"}, 2)


def test_cuda_cluster_names_what_is_missing():
    try:
        import dask_cuda  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match=r"gpu-cu13.*gpu-cu12"):
            cuda_cluster()
    else:
        if not torch.cuda.is_available():
            with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
                cuda_cluster()


# -- the 1B-shape model ---------------------------------------------------------------------------
def test_llama_1b_recipe_is_the_published_shape():
    from daskflow_kv.model.zoo.random_llama import random_config, parameter_count

    cfg = random_config("llama-3.2-1b-random")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (16, 2048, 8192)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (32, 8, 64, 128256)
    assert cfg.tie_word_embeddings and cfg.rope_parameters["rope_type"] == "llama3"
    assert cfg.rope_parameters["rope_theta"] == 500000.0 and cfg.max_position_embeddings == 131072
    assert 1.23e9 < parameter_count(cfg) < 1.24e9  # "1.24 B"
    kv_bytes_per_token_bf16 = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * 2
    assert kv_bytes_per_token_bf16 == 32 * 1024


def test_llama_mini_builds_offline_and_resumes_exactly(tmp_path, monkeypatch):
    """The same recipe at a CPU width: built, loaded by name, and exact across modes."""
    from daskflow_kv.engine import Engine
    from daskflow_kv.model.runner import ModelRunner
    from daskflow_kv.model.zoo.loader import load_model
    from daskflow_kv.model.zoo.random_llama import parameter_count, random_config

    monkeypatch.setenv("DASKFLOW_KV_CACHE", str(tmp_path))
    lm = load_model("llama-3.2-1b-mini", "float32")
    assert lm.path.parent == tmp_path / "models" and (lm.path / "daskflow_kv.json").exists()
    info = json.loads((lm.path / "daskflow_kv.json").read_text())
    assert info["weights"] == "random" and info["drawn_on"] == "cpu"
    big, mini = random_config("llama-3.2-1b-random"), lm.model.config
    assert mini.head_dim == big.head_dim and mini.rope_parameters == big.rope_parameters
    assert mini.tie_word_embeddings and mini.num_attention_heads % mini.num_key_value_heads == 0
    assert sum(p.numel() for p in lm.model.parameters()) == parameter_count(mini)
    eng = Engine(runner=ModelRunner(lm.model, lm.tokenizer, lm.model_id, 16))
    ctx = eng.encode("The shared context is prefilled once and every agent resumes from it. " * 2)
    kids = eng.fork(eng.materialize(ctx), 2)
    for kid, suf in zip(kids, [" One?", " Two, longer?"]):
        s = eng.encode(suf)
        assert eng.resume(kid, s, max_new_tokens=6).tokens == eng.generate_text(ctx + s, 6).tokens


# -- packaging: extras and the wheel slimmer ------------------------------------------------------
def test_gpu_extras_per_cuda_major():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "gpu" not in extras
    for cu in ("12", "13"):
        reqs = " ".join(extras[f"gpu-cu{cu}"])
        assert f"cupy-cuda{cu}x" in reqs and f"distributed-ucxx-cu{cu}" in reqs and f"dask-cuda[cu{cu}]" in reqs


def test_slim_wheel_drops_files_and_their_record_lines(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from slim_wheel import slim
    finally:
        sys.path.pop(0)
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("pkg/__init__.py", "")
        z.writestr("pkg/lib/libx.so", b"\0" * 100)
        z.writestr("pkg/lib/libx.a", b"\1" * 1000)
        z.writestr("pkg/include/x.h", "int x;")
        z.writestr("pkg-1.0.dist-info/RECORD",
                   "pkg/__init__.py,,\npkg/lib/libx.so,,\npkg/lib/libx.a,,\npkg/include/x.h,,\npkg-1.0.dist-info/RECORD,,\n")
    dropped, before, after = slim(str(whl), ["pkg/lib/*.a", "pkg/include/*"])
    assert dropped == 2
    with zipfile.ZipFile(whl) as z:
        assert sorted(z.namelist()) == ["pkg-1.0.dist-info/RECORD", "pkg/__init__.py", "pkg/lib/libx.so"]
        record = z.read("pkg-1.0.dist-info/RECORD").decode()
    assert "libx.a" not in record and "x.h" not in record and "pkg/lib/libx.so" in record


def test_driver_runs_every_phase_on_cpu(tmp_path, monkeypatch):
    """The whole driver, CPU smoke mode (TCP LocalCluster, NumPy for CuPy, the 1B recipe at mini
    width): every phase runs and fills the result file; the GPU run differs only in devices."""
    monkeypatch.setenv("DASKFLOW_KV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "smoke.json"
    rc = gpu_check.main(["--cpu-smoke", "--out", str(out), "--model", "llama-3.2-1b-mini", "--sizes-mib", "1",
                         "--reps", "1", "--state-tokens", "128", "--context-tokens", "128", "--agents", "2",
                         "--max-new-tokens", "4", "--budget", "500"])
    doc = json.loads(out.read_text())
    assert doc["status"] == "complete" and doc["errors"] == [], doc["errors"]
    assert set(doc["timings"]["phases"]) == set(gpu_check.PHASES)
    assert doc["agree"] is True and doc["protocol"] == "tcp"
    assert {"tiny-llama/float32", "tiny-llama/bfloat16"} <= set(doc["agreement"])
    assert all(doc["agreement"]["tiny-llama/bfloat16"].values())
    kinds = {r["kind"] for r in doc["transfer"]}
    assert {"kv-tensor", "cupy", "kv-blocks", "cupy-blocks"} <= kinds
    assert doc["transfer_gbps"] > 0 and doc["cupy_gbps"] > 0 and doc["tcp_gbps"] > 0
    wf = doc["timings"]["workflow"]
    assert wf["state"]["wall_s"] > 0 and wf["text"]["ttft_mean_s"] > 0
    # Host tensors are never counted, and nothing arrived on a device: the check says so.
    assert doc["received_on_device"] is False and doc["host_staging"] is True and rc == 2
