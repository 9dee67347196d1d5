"""The persistent KV tier: content-addressed blocks that outlive the cluster.

Worker memory is the fast tier, Dask's spill-to-disk the middle one; this part is the
slow, durable one: a directory or any ``fsspec`` URL (``file://``, ``s3://``, ``gs://``,
``memory://`` for tests) holding one object per block under the block's content address.
A key already covers model, weights, tokenizer, dtype, positions and the tenant's secret
(``state.blocks``), so a new cluster that computes the same keys finds the same blocks.

Tenants share the store but not its objects: each writes under its own directory, every
object sealed (AES-256-GCM) with a key derived from its secret, so another tenant can
neither read its K/V nor make it load theirs (``tenant``, ``codec``).

Owns: the tenant's credential (``tenant``: ``StoreTenant``), where objects live
(``layout``), the object format (``codec``: manifest and tensor sealed for the tenant,
bound to the object's name; a manifest without token ids), the back ends (``backends``:
atomic writes), the store itself (``kv_store``: one tenant's get / put / leading run /
discard), maintenance (``maintenance``: ls, du, gc, and an admin's view of every tenant)
and its CLI (``commands``). No Dask: the runtime decides when to read and write, on which
worker, for which tenant.

May import: ``errors``, ``config``, ``validation`` and ``state`` (block keys). Nothing is
imported here: the CLI reaches ``commands`` without loading torch.
"""
