"""Benchmarks of daskflow-kv against its baselines (issue 7), and a cluster-scale planner.

    python -m daskflow_kv.bench --quick            # tiny-llama, every experiment, a few minutes on 2 cores
    python -m daskflow_kv.bench --profile full --warm --reps 3   # SmolLM2-135M: the published run
    python -m daskflow_kv.bench.plan --model llama-3-8b --hardware a100-ib200   # MODELED

``run.main(argv)`` and ``plan.main(argv)`` are the entry points (``daskflow-kv bench`` and
``daskflow-kv plan``). Modules: ``common`` (machine info, result files, memory samplers),
``workload`` (the shared prompts), ``systems`` (the four systems compared, one TTFT
definition), ``worker_tasks`` (functions that run inside Dask tasks), ``local_engine`` and
``router`` (the ``local`` baseline: a per-worker engine behind a cache-aware router),
``experiments`` (exp 1-5), ``multiround`` (exp 6), ``load`` (exp 7), ``netem`` (real bandwidth
throttling with network namespaces), ``summary`` (medians, best baseline, targets),
``report`` and ``report_md`` (CSV/JSON/plots/SUMMARY.md), ``readme_blocks`` (the README blocks).
"""
