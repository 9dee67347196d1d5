"""A worker's report of its continuous-batching loop, as the scheduler keeps it: numbers checked."""

from daskflow_kv.plugins.kv_engines import EngineGauges, gauge_of, merge


def test_a_reported_loop_is_kept_with_its_mean_batch_and_bad_numbers_are_dropped():
    g = EngineGauges()
    g.update("w", {"batch": 3, "step_s": 0.02, "waiting": 1, "running": 3, "steps": 10, "batch_total": 25,
                   "completed": 4})
    assert g.of("w").batch == 3 and g.of("w").as_dict()["mean_batch"] == 2.5
    for bad in ({"batch": -1}, {"step_s": float("nan")}, {"steps": True}, "x", {"waiting": 2 ** 60}):
        assert gauge_of(bad) is None
        g.update("w", bad)
    assert g.of("w").batch == 3  # the last good report stands
    g.forget_worker("w")
    assert g.of("w").steps == 0


def test_a_workers_loops_merge_into_one():
    m = merge({"a": {"batch": 2, "step_s": 0.1, "steps": 5, "batch_total": 8},
               "b": {"batch": 1, "step_s": 0.3, "steps": 1, "batch_total": 1}})
    assert (m["batch"], m["step_s"], m["steps"], m["batch_total"]) == (3, 0.3, 6, 9)
