"""Where a stream's prompt work went, from the prefill events its workers reported.

A workflow counts the prefill it planned (``tokens_prefilled``: each materialize's
``len(tokens) - reused`` as planned, each resume's and each rebuild's); the workers report
what each finished prefill task computed (``keys.PREFILL_TOPIC``). The two part where a plan
and the run differ, which ``ledger`` sorts out of the events alone:

* ``again``: a prefill of a state (a chunk of one) already reported in the window: Dask ran
  the task again (a block it made was evicted or lost, then read: lineage);
* ``alone_excess``: a chunk of a parallel materialize that could not cooperate prefills
  every token from the cached prefix to its chunk's end: the tokens before its own span are
  computed twice;
* ``chunk_tokens``: tokens the chunks of parallel materializes computed (relayed or alone),
  outside the step loop: the part of ``by_op`` no step's ``prompt_tokens`` shows;
* ``by_op``: every reported token, by operator.

Plain data in, plain data out: the bench calls it on a row's events (``load.measure_row``).
"""

from __future__ import annotations


def ledger(events: list[dict]) -> dict:
    """``{"by_op", "again", "again_tasks", "alone_excess", "alone_chunks", "chunk_tokens", "states"}`` of ``events``
    (prefill events, calibration excluded by the caller), in the order they were reported."""
    by_op: dict[str, int] = {}
    again: dict[str, int] = {}
    seen: set[tuple] = set()
    again_tasks = excess = alone = chunked = 0
    for e in events:
        op, n = str(e.get("op", "")), int(e.get("new_tokens") or 0)
        by_op[op] = by_op.get(op, 0) + n
        task = (e.get("state_id"), e.get("chunk"))
        if task in seen:
            again[op] = again.get(op, 0) + n
            again_tasks += 1
        seen.add(task)
        if "chunk" in e:
            chunked += n
            if e.get("relayed") is False:  # it computed from the cached prefix, not from its span's start
                alone += 1
                span = e.get("span")
                excess += max(0, span[0] - int(e.get("prefix_tokens") or 0)) if span else 0
    return {"by_op": by_op, "again": again, "again_tasks": again_tasks, "alone_excess": excess,
            "alone_chunks": alone, "chunk_tokens": chunked, "states": len({s for s, _ in seen})}
