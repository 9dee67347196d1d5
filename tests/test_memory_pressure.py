"""The memory-pressure scenario of benchmarks/memory_pressure.py, short: workers whose Dask spill
threshold sits below the loaded model's own memory, so every KV block goes to disk as soon as
it is made and is read back when used; no KV budget. Nothing may hang and every workflow
must give text replay's tokens."""

from daskflow_kv.bench.memory_pressure import run_memory_pressure


def test_kv_spilled_to_disk_as_it_is_made_stays_exact_and_nothing_hangs():
    out = run_memory_pressure(model="tiny-llama", workflows=4, docs=2, context=256,
                              thresholds={"target": 0.4, "spill": 0.5}, hang_s=240, log=lambda *a: None)
    assert not out["hung"] and out["completed"] == 4, out["errors"]
    assert out["wrong"] == 0
    # Dask really spilled KV blocks (counted as written: a spill read back between two samples
    # of what sits on disk was missed by the samples on a fast host)
    assert out["spilled_disk_bytes_total"] > 0


def test_a_paused_worker_gives_freed_heap_back_to_the_os():
    """What ``KVWorkerPlugin`` does while Dask keeps a worker paused: freed memory that the
    allocator kept (holes between live allocations) goes back, so process memory can fall
    below the pause threshold again."""
    import numpy as np
    import psutil

    from plugins.worker import trim_memory

    proc = psutil.Process()
    chunks = [np.ones(60_000, dtype=np.uint8) for _ in range(4000)]  # ~240 MB in heap-sized pieces
    keep = chunks[1::2]  # every other one stays live: the freed ones are holes, not the heap's top
    del chunks
    before = proc.memory_info().rss
    trim_memory()
    after = proc.memory_info().rss
    assert before - after > 50 * 2**20, (before, after)
    assert len(keep) == 2000
