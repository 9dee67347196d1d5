"""Settings live in dask.config["daskflow-kv"]: shipped defaults, YAML, environment, overrides."""

import os
import subprocess
import sys

import dask
import pytest
import yaml

from daskflow_kv import config
from daskflow_kv.plugins.kv_scheduler import KVSchedulerPlugin


def test_defaults_come_from_the_shipped_yaml():
    shipped = yaml.safe_load(config.DEFAULTS_FILE.read_text())["daskflow-kv"]
    assert config.get("block-size") == shipped["block-size"] == 64
    assert config.get("kv-budget") is None
    assert config.get_bytes("calibration.probe-bytes") == 32 << 20
    assert config.get_seconds("scheduler.evict-interval") == pytest.approx(0.2)


def test_keyword_arguments_win_over_config():
    with dask.config.set({"daskflow-kv.block-size": 16}):
        assert config.get("block-size") == 16
        assert config.get("block-size", 32) == 32


def test_scheduler_plugin_reads_its_knobs_from_config():
    with dask.config.set({"daskflow-kv.kv-budget": "8MiB", "daskflow-kv.scheduler.lease": "500ms"}):
        plugin = KVSchedulerPlugin()
        assert plugin.kv_budget_bytes == 8 << 20
        assert plugin.lease_seconds == pytest.approx(0.5)
        assert KVSchedulerPlugin(kv_budget_bytes="1GiB").kv_budget_bytes == 1 << 30


def test_environment_variables_and_yaml_files_reach_it(tmp_path):
    """As Dask users expect: DASK_DASKFLOW_KV__... and a YAML in DASK_CONFIG."""
    (tmp_path / "kv.yaml").write_text(yaml.safe_dump({"daskflow-kv": {"calibration": {"probe-tokens": 512}}}))
    env = {**os.environ, "DASK_DASKFLOW_KV__KV_BUDGET": "2GiB", "DASK_DASKFLOW_KV__BLOCK_SIZE": "32",
           "DASK_CONFIG": str(tmp_path)}
    code = ("from daskflow_kv import config; "
            "print(config.get_bytes('kv-budget'), config.get('block-size'), config.get('calibration.probe-tokens'),"
            " config.get('dtype'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [str(2 << 30), "32", "512", "float32"]


def test_engine_takes_block_size_and_model_from_config():
    from daskflow_kv.engine import Engine

    with dask.config.set({"daskflow-kv.block-size": 8, "daskflow-kv.model": "tiny-qwen2"}):
        eng = Engine()
    assert eng.block_size == 8
    assert "qwen2" in eng.fingerprint.model_id
    state = eng.materialize(list(range(3, 23)))
    assert [b.end - b.start for b in state.blocks] == [8, 8, 4]


def test_a_bad_duration_or_size_setting_is_one_line_naming_it():
    import dask
    import pytest

    from daskflow_kv import config
    from daskflow_kv.errors import InvalidInputError

    with dask.config.set({"daskflow-kv.scheduler.reuse-hint": "soon", "daskflow-kv.kv-budget": "lots"}):
        with pytest.raises(InvalidInputError, match=r"^daskflow-kv\.scheduler\.reuse-hint: 'soon' is not a duration"):
            config.get_seconds("scheduler.reuse-hint")
        with pytest.raises(InvalidInputError, match=r"^daskflow-kv\.kv-budget: 'lots' is not a byte size"):
            config.get_bytes("kv-budget")
