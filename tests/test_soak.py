"""The soak of benchmarks/soak.py, short: two clients stream workflows under a KV budget that
forces evictions (room for 1.5 workflows per worker, 2 in flight: it binds whatever the machine's speed), with a persistent store; every run agrees with its text replay, none is lost,
and once the clients close no KV key is left that nothing retains on purpose."""

from daskflow_kv.bench.soak import SoakConfig, growth, levels_off, peak_growth, run_soak
from daskflow_kv.runtime.cluster import local_cluster


def test_a_short_soak_loses_nothing_and_leaves_only_the_cache(tmp_path):
    cfg = SoakConfig(minutes=0.15, concurrency=2, pool=3, budget_workflows=1.5, sample_every=3.0, warmup_minutes=0.05, hang_s=30.0)
    with local_cluster(2, 1, dashboard_address=None) as cluster:
        out = run_soak(cluster, 2, cfg, str(tmp_path / "kv"), log=lambda *a: None)
    assert out["workflows"] >= 3 and out["completed"] == out["workflows"], out["errors"]
    assert out["hung_threads"] == 0 and out["wrong"] == 0
    assert out["evictions"] > 0  # the budget bound
    assert out["keys_left_after_clients_closed"]["wanted_by_no_one"] == 0
    assert out["keys_left_after_clients_closed"]["wanted_by_others"] == 0
    assert out["sessions_left"] == 0


def test_growth_compares_the_streams_end_with_the_end_of_warm_up():
    samples = [{"at_s": t, "scheduler_rss": rss, "leases": n} for t, rss, n in
               [(0, 50, 0), (10, 100, 2), (20, 100, 4), (30, 104, 3), (40, 110, 3), (50, 110, 0)]]
    g = growth(samples, warmup_s=10, n=2)  # (100+100)/2 -> (110+110)/2; leases 3 -> 1.5
    assert abs(g["scheduler_rss"] - 0.10) < 1e-9 and g["leases"] == -0.5 and g["tasks"] is None


def test_in_flight_gauges_level_off_by_their_peaks_memory_by_its_ends():
    base = {"scheduler_rss": 100, "dask_spans": 10}
    flat = [{**base, "at_s": t, "dask_spans": 1 + 9 * (t % 20 == 0)} for t in range(0, 100, 10)]
    flat[0]["dask_spans"], flat[-1]["dask_spans"] = 1, 8  # 1 -> 8: +700 % by the ends, below the first peak
    assert growth(flat, 0, n=1)["dask_spans"] == 7.0 and peak_growth(flat, 0)["dask_spans"] == 0.0
    assert levels_off(flat, 0)
    rising = [{**s, "scheduler_rss": 100 + s["at_s"] / 2} for s in flat]  # 100 -> 145 MiB: memory grows
    assert not levels_off(rising, 0)
    climbing = [{**s, "dask_spans": 1 + s["at_s"]} for s in flat]  # peaks that keep climbing
    assert peak_growth(climbing, 0)["dask_spans"] > 0.1 and not levels_off(climbing, 0)
