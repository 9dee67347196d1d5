"""Benchmarks of daskflow-kv against its baselines (issue 7), and a cluster-scale planner.

    python -m daskflow_kv.bench --quick            # CI smoke: tiny-llama, a few minutes on 2 cores
    python -m daskflow_kv.bench --profile full     # SmolLM2-135M, every experiment
    python -m daskflow_kv.bench.plan --model llama-3-8b --hardware a100-ib200   # MODELED

``run.main(argv)`` and ``plan.main(argv)`` are the entry points (``daskflow-kv bench`` and
``daskflow-kv plan``). Modules: ``common`` (machine info, result files, memory samplers),
``workload`` (the shared prompts), ``systems`` (the four systems compared), ``worker_tasks``
(functions that run inside Dask tasks), ``experiments`` (exp 1-5), ``netem`` (real
bandwidth throttling with network namespaces), ``report`` (CSV/JSON/plots/SUMMARY.md).
"""
