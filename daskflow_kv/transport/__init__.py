"""How KV tensors travel between Dask processes: zero-copy serializers, true ``sizeof``, and
the per-process counters that prove CUDA blocks never stage through host memory.

May import: ``daskflow_kv.errors``, ``daskflow_kv.config``, torch, dask and distributed.
Imported by every process that sends or receives tensors (client, workers); never by the
scheduler (which moves frames without reading them).
"""
