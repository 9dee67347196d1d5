"""Pure policy: transfer vs recompute, where each consumer runs, what to evict.

Plain functions on plain data (numbers, dicts, dataclasses): no torch, no Dask, no
numpy, so every decision is unit-tested without a cluster or a model and can run inside
the scheduler's event loop.

Owns: the cost model (``cost_model``: prefill profiles, link profiles, ``decide``),
placement of KV consumers over workers (``placement``), eviction scoring (``eviction``).

May import: ``daskflow_kv.errors`` and the standard library only.
"""
