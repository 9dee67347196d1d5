"""Every KV byte the budget counts was admitted first: a result holds no more than declared.

Admission reserves what a task declares and the budget counts what results hold once they
are in memory (``kv_usage``: the size the worker measured). A task that declared 0 and
returned 80 KiB ran outside admission, and then, pinned by its client, counted against
everyone's room: with quotas of 48 KiB under a 100 KiB budget, a tenant refused 80 KiB took
it that way and another tenant's next prefill failed. So, with tenants configured, the
size a worker reports for a KV-holding task's result is checked before the scheduler takes
it (``dask_internals.guard_task_finished``):

* a task that declared its KV - a compute task its ``kv_out``, a block copied from another
  block its ``nbytes``, both admitted on them (``kv_budget``) - may hold that, plus a little
  for the Python objects around its tensors (``slack``);
* a cut of a KV output (a block, a branch, a replica: a task ``kv_ownership`` lets run
  without a declaration only because it depends on an output of its namespace) shares that
  output's tensors: all cuts of one output together may hold what that output holds.

A result over its allowance errs its task with one ``KVBudgetError`` line, as if it had
raised on the worker, which then frees it: Dask never holds it, nothing of it is counted
or pinned, and the owner of the room it would have taken never notices.

The worker measures with ``dask.sizeof``. A result whose own type misreports its size is
invisible to the budget as well: it takes nothing from another tenant's admitted room, only
worker memory, which Dask's own limits govern like anything ``client.run`` does (outside
the boundary, docs/security.md).
"""

from __future__ import annotations

from daskflow_kv.errors import KVBudgetError
from daskflow_kv.keys import holds_kv, is_output, short_key, tag_of

SLACK_BYTES = 512  # a result's Python objects besides its tensors (the sizes runtime/tasks.py registers)
SLACK_RATIO = 8  # ... plus 1/8 of what it declared: 64 bytes per tensor of >= 8 KiB, 8 per token generated


def slack(declared: int) -> int:
    """How far a result may exceed the ``declared`` bytes it was admitted on."""
    return SLACK_BYTES + declared // SLACK_RATIO


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


class DeclaredKV:
    __slots__ = ("_scheduler", "_declared", "_left", "_drawn")

    def __init__(self, scheduler):
        self._scheduler = scheduler  # each result's dependencies (what a cut is cut from)
        self._declared: dict = {}  # key -> KV bytes its task was admitted on (until Dask forgets it)
        self._left: dict = {}  # KV output in memory -> bytes its cuts may still hold
        self._drawn: dict = {}  # cut in memory -> [(output, bytes it holds of that output's)]

    def declare(self, key, nbytes: int) -> None:
        """An admitted task declares the ``nbytes`` of KV its result holds."""
        self._declared[key] = int(nbytes)

    def refused(self, key, worker: str, nbytes) -> KVBudgetError | None:
        """Why the result ``worker`` reports for ``key`` (``nbytes``, as it measured it) may not
        be taken, or None: then it is taken, and a cut's share of its outputs is used up."""
        if not holds_kv(key):
            return None
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes < 1 << 62:
            return KVBudgetError(f"task {short_key(key)}: its worker reported no size for its K/V; refused")
        if key in self._declared:
            allowed = self._declared[key]
            if nbytes > allowed + slack(allowed):
                return KVBudgetError(f"task {short_key(key)} declared {_kib(allowed)} of KV and its result holds "
                                     f"{_kib(nbytes)}: refused (its result was freed)")
        else:
            ts = self._scheduler.tasks.get(key)
            # Only its own namespace's outputs: a cut of another's would use up what theirs may hold.
            sources = [d.key for d in (ts.dependencies if ts is not None else ())
                       if d.key in self._left and tag_of(d.key) == tag_of(key)]
            allowed = sum(self._left[s] for s in sources)
            if nbytes > allowed + SLACK_BYTES:
                return KVBudgetError(f"task {short_key(key)} is cut from KV outputs holding {_kib(allowed)} and its "
                                     f"result holds {_kib(nbytes)}: refused (its result was freed)")
            self._draw(key, sources, nbytes)
        if is_output(key):
            self._left[key] = nbytes  # what its cuts may hold
        return None

    def _draw(self, key, sources: list, nbytes: int) -> None:
        drawn, need = [], nbytes
        for s in sources:
            take = min(need, self._left[s])
            self._left[s] -= take
            drawn.append((s, take))
            need -= take
        self._drawn[key] = drawn

    def left_memory(self, key) -> None:
        """``key``'s result left memory: its cuts may hold nothing more of it, and what it held
        of its outputs is theirs again (a cut Dask makes again draws it anew)."""
        self._left.pop(key, None)
        for s, n in self._drawn.pop(key, ()):
            if s in self._left:
                self._left[s] += n

    def forget(self, key) -> None:
        """Dask forgot ``key``: its next task declares again."""
        self._declared.pop(key, None)
        self.left_memory(key)
