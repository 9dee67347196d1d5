"""TLS for every connection of a KV cluster: client, scheduler and workers.

Dask's own ``distributed.Security`` does the work; this module only builds one from what a
user has: nothing (then Dask's ``distributed.comm.tls.*`` configuration, if any), a
temporary self-signed authority for a cluster started here (``temporary=True``: needs the
``tls`` extra, i.e. ``cryptography``), or certificate files. With TLS the cluster's
addresses are ``tls://`` and only holders of a certificate the CA signed can connect.
"""

from __future__ import annotations


def kv_security(temporary: bool = False, ca_file: str | None = None, cert: str | None = None,
                key: str | None = None):
    """A ``distributed.Security``, or None for plain TCP."""
    from distributed import Security

    if temporary:
        try:
            return Security.temporary()
        except ImportError as e:
            raise RuntimeError("a temporary TLS authority needs cryptography: pip install 'daskflow-kv[tls]'") from e
    if not (ca_file or cert or key):
        return None
    files = dict(tls_ca_file=ca_file, tls_client_cert=cert, tls_client_key=key,
                 tls_scheduler_cert=cert, tls_scheduler_key=key, tls_worker_cert=cert, tls_worker_key=key)
    return Security(require_encryption=True, **{k: v for k, v in files.items() if v})
