"""The persistent KV tier: content-addressed blocks that outlive the cluster.

Worker memory is the fast tier, Dask's spill-to-disk the middle one; this part is the
slow, durable one: a directory or any ``fsspec`` URL (``file://``, ``s3://``, ``gs://``,
``memory://`` for tests) holding one object per block under the block's content address.
A key already covers model, weights, tokenizer, dtype, positions and the tenant's secret
(``state.blocks``), so a new cluster that computes the same keys finds the same blocks.

Owns: the object format (``codec``: safetensors + a manifest without token ids, checksum),
the back ends (``backends``: atomic writes), the store itself (``kv_store``: get / put /
leading run / discard), maintenance (``maintenance``: ls, du, gc) and its CLI
(``commands``). No Dask: the runtime decides when to read and write, on which worker.

May import: ``errors``, ``config``, ``validation`` and ``state`` (block keys). Nothing is
imported here: the CLI reaches ``commands`` without loading torch.
"""
