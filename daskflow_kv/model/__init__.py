"""Model execution: forward passes over KV blocks, exactly as text mode would compute them.

Owns: ``ModelRunner`` (load a prefix from blocks, prefill, decode, export blocks), the
position-invariant attention kernel, the growable cache layer, batched resume of k forks
over one prefix (``batched``, ``batched_cache``), sampling, the tokenizer codec, and the
model zoo (``zoo``: tiny models built offline, SmolLM2 from its package, any local path).

May import: ``daskflow_kv.state`` (block arithmetic, fingerprints), ``daskflow_kv.errors``,
torch and transformers. Never Dask, a runtime, or the workflow layer.
"""
