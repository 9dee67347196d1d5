"""daskflow-kv as Dask users expect it: settings on import, ``dask kv``, output that pipes."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from daskflow_kv.state.blocks import block_key
from daskflow_kv.store.backends import LocalDirBackend
from daskflow_kv.store.kv_store import KVStore

BIN = Path(sys.executable).parent


def _run(code_or_argv, **kw):
    argv = [sys.executable, "-c", code_or_argv] if isinstance(code_or_argv, str) else code_or_argv
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


def test_import_registers_the_settings_without_torch():
    """As distributed, dask-cuda and dask-jobqueue do: importing the package is enough."""
    code = ("import sys, dask, daskflow_kv; "
            "print(dask.config.get('daskflow-kv.kv-budget'), dask.config.get('daskflow-kv.block-size'), "
            "dask.config.get('daskflow-kv.dtype'), "
            "sorted(m for m in ('torch', 'transformers', 'distributed') if m in sys.modules))")
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["None", "64", "float32", "[]"]


def test_environment_overrides_the_defaults_registered_on_import():
    proc = _run("import dask, daskflow_kv; print(dask.config.get('daskflow-kv.block-size'))",
                env={**os.environ, "DASK_DASKFLOW_KV__BLOCK_SIZE": "32"})
    assert proc.stdout.strip() == "32", proc.stderr


def _dask():
    exe = BIN / "dask"
    if not exe.exists():
        pytest.skip("no `dask` console script next to this interpreter (package not installed)")
    return str(exe)


def test_dask_kv_is_the_daskflow_kv_command():
    """The dask_cli entry point from pyproject.toml, as installed: `dask kv` lists and runs."""
    listing = _run([_dask(), "--help"])
    assert listing.returncode == 0 and " kv " in listing.stdout, listing.stdout
    helped = _run([_dask(), "kv", "--help"])
    assert helped.returncode == 0, helped.stderr
    assert helped.stdout.startswith("usage: dask kv ")
    for sub in ("run", "explain", "store", "catalog", "bench"):
        assert sub in helped.stdout
    same = _run([sys.executable, "-m", "daskflow_kv.cli", "--help"])
    # The same program: the same help, but for the program's name (argparse wraps the usage line by its length).
    assert same.stdout.split("\n\n", 1)[1] == helped.stdout.split("\n\n", 1)[1]
    bad = _run([_dask(), "kv", "store", "gc", "--kv-store", "/tmp", "--older-than", "soon"])
    assert bad.returncode == 2 and bad.stderr.startswith("dask kv: error: --older-than"), bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def big_store(tmp_path_factory):
    """A store whose `ls` prints well over a pipe's 64 KiB, so the reader leaves mid-way."""
    root = tmp_path_factory.mktemp("kv") / "store"
    store = KVStore(LocalDirBackend(str(root)), touch_interval=0)
    block = torch.zeros((1, 2, 1, 4, 2))
    for i in range(800):
        store.put(block, block_key("fp", None, [i, 1, 2, 3]), 0, 4, "fp")
    return str(root)


@pytest.mark.parametrize("command", [["daskflow-kv"], ["dask", "kv"]], ids=["daskflow-kv", "dask-kv"])
def test_piped_output_ends_cleanly(big_store, command):
    """`... store ls | head` exits 0 with nothing on stderr (pipefail: our own status counts)."""
    exe = BIN / command[0]
    if shutil.which("bash") is None or not exe.exists():
        pytest.skip(f"needs bash and the {command[0]} console script")
    line = f"set -o pipefail; {' '.join([str(exe), *command[1:]])} store ls --kv-store {big_store} | head -n 3"
    proc = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert len(proc.stdout.splitlines()) == 3 and proc.stdout.startswith("key ")


def test_a_reader_gone_before_the_first_line(big_store):
    """The pipe closed before anything is written (`| head -c0`): still no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "daskflow_kv.cli", "store", "ls", "--kv-store", big_store],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert err == ""
