"""Export the KV catalog as Parquet or Arrow IPC, from Python or from the command line.

The catalog is the scheduler plugin's table of (state, block) rows: token ranges, bytes,
workers, refcounts, lifecycle status, lineage (``daskflow_kv.state.catalog.ARROW_COLUMNS``).

    from daskflow_kv.runtime.catalog_export import export_catalog, catalog_table
    export_catalog(rt, "kv.parquet")                  # a KVRuntime, a Client or an address
    table = catalog_table("tcp://scheduler:8786")     # a pyarrow.Table

    daskflow-kv catalog --scheduler tcp://scheduler:8786 --out kv.parquet
    daskflow-kv catalog --scheduler tcp://scheduler:8786 --out kv.arrow --format arrow

``arrow`` writes the Arrow IPC *file* format (what ``pyarrow.ipc.open_file`` and
``pyarrow.feather.read_table`` read); ``arrow-stream`` the IPC stream format (what the
dashboard's ``/kv/catalog.arrow`` serves and ``pyarrow.ipc.open_stream`` reads).
"""

from __future__ import annotations

import os

from .. import validation

FORMATS = ("parquet", "arrow", "arrow-stream")
_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".arrow": "arrow", ".feather": "arrow", ".ipc": "arrow",
             ".arrows": "arrow-stream"}


_NO_PLUGIN = ("the scheduler has no daskflow-kv plugin (no kv_catalog handler): start it with "
              "`dask scheduler --preload daskflow_kv.plugins.kv_scheduler` or create a KVRuntime on it")


def _rows_from_client(client) -> list[dict]:
    """The rows this client's tenant may see (it logs in with daskflow-kv.namespace/secret)."""
    from .session import login

    try:
        session = login(client)
        rows = client.sync(client.scheduler.kv_catalog, session=session.token)
    except (KeyError, ValueError) as e:
        if "kv_" in str(e):
            raise RuntimeError(_NO_PLUGIN) from e
        raise
    if rows is None:  # an unknown handler answers nothing
        raise RuntimeError(_NO_PLUGIN)
    return rows


def catalog_table(source):
    """The KV catalog as a pyarrow Table.

    ``source``: a ``KVRuntime`` (anything with ``.catalog()``), a ``distributed.Client``,
    a scheduler address (a client is opened and closed here), a scheduler plugin (anything
    with ``catalog_table()`` or ``operator_catalog()``), a list of catalog rows, or a Table.
    """
    import pyarrow as pa

    from ..state.catalog import rows_to_arrow

    if isinstance(source, pa.Table):
        return source
    if isinstance(source, list):
        return rows_to_arrow(source)
    if isinstance(source, str):
        from distributed import Client

        validation.scheduler_reachable("scheduler address", source)
        with Client(source, timeout="10s", set_as_default=False) as client:
            return rows_to_arrow(_rows_from_client(client))
    if callable(getattr(source, "catalog", None)):  # KVRuntime
        return source.catalog()
    if callable(getattr(source, "catalog_table", None)):  # KVSchedulerPlugin
        return source.catalog_table()
    if callable(getattr(source, "operator_catalog", None)):
        return rows_to_arrow(source.operator_catalog())
    if hasattr(source, "scheduler") and callable(getattr(source, "sync", None)):  # Client
        return rows_to_arrow(_rows_from_client(source))
    raise TypeError(f"cannot read a KV catalog from {type(source).__name__}")


def infer_format(path, format: str | None = None) -> str:
    if format:
        return validation.choice("format", format, FORMATS)
    return _SUFFIXES.get(os.path.splitext(str(path))[1].lower(), "parquet")


def write_table(table, path, format: str | None = None) -> str:
    """Write ``table`` to ``path`` as parquet | arrow | arrow-stream; returns the format used."""
    import pyarrow as pa

    fmt = infer_format(path, format)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pq.write_table(table, str(path))
    else:
        opener = pa.ipc.new_file if fmt == "arrow" else pa.ipc.new_stream
        with pa.OSFile(str(path), "wb") as sink, opener(sink, table.schema) as writer:
            writer.write_table(table)
    return fmt


def export_catalog(source, path, format: str | None = None):
    """Write the KV catalog of ``source`` (see ``catalog_table``) to ``path``; returns the Table.

    ``format``: "parquet", "arrow" (IPC file) or "arrow-stream"; by default from the
    suffix of ``path`` (.parquet/.pq, .arrow/.feather/.ipc, .arrows), else parquet.
    """
    table = catalog_table(source)
    write_table(table, path, format)
    return table


def read_catalog(path, format: str | None = None):
    """Read back a file ``export_catalog`` wrote, as a pyarrow Table."""
    import pyarrow as pa

    fmt = infer_format(path, format)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(str(path))
    with pa.memory_map(str(path), "r") as src:
        reader = pa.ipc.open_file(src) if fmt == "arrow" else pa.ipc.open_stream(src)
        return reader.read_all()


# -- command line ---------------------------------------------------------------------------
def add_catalog_subcommand(subparsers):
    """Add ``catalog`` to the ``daskflow-kv`` CLI's subparsers; it runs ``cmd_catalog``."""
    p = subparsers.add_parser("catalog", help="export the KV catalog of a running scheduler (Parquet / Arrow IPC)")
    p.add_argument("--scheduler", required=True, help="scheduler address, e.g. tcp://127.0.0.1:8786")
    p.add_argument("--out", required=True, help="output file (.parquet, .arrow, .arrows)")
    p.add_argument("--format", default=None, choices=FORMATS, help="default: from the suffix of --out")
    p.set_defaults(func=cmd_catalog)
    return p


def cmd_catalog(args) -> int:
    validation.writable_file("--out", args.out)
    validation.scheduler_reachable("--scheduler", args.scheduler)
    table = catalog_table(args.scheduler)
    fmt = write_table(table, args.out, args.format)
    states = len({s for s in table.column("state_id").to_pylist() if s}) if table.num_rows else 0
    print(f"wrote {args.out} ({fmt}): {table.num_rows} rows, {states} states, "
          f"{len(set(table.column('block_key').to_pylist()))} blocks")
    return 0


def main(argv=None) -> int:
    """``python -m daskflow_kv.runtime.catalog_export --scheduler ADDR --out kv.parquet``."""
    import sys

    from ..errors import InvalidInputError

    parser = validation.ArgumentParser(prog="daskflow-kv")
    add_catalog_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["catalog", *(argv if argv is not None else sys.argv[1:])])
    try:
        return args.func(args)
    except InvalidInputError as e:
        print(f"daskflow-kv catalog: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
