"""The KV state algebra: what a cached context *is*, independent of any model or cluster.

Owns: ``KVState`` descriptors and their lineage, content-addressed ``BlockRef``s and
their chained keys, the in-process ``BlockStore``, the ``PrefixIndex`` (radix walk over
block keys), ``Fingerprint`` (what a state is valid for), compatibility checks, and the
scheduler-side ``KVCatalog``.

May import: ``daskflow_kv.errors`` and the standard library (torch only for tensors held
by the in-process store and for fingerprinting a loaded model). Never a model runner,
Dask, or anything above.
"""
