"""A KV key is only ever what its own tenant's task computed under it.

Dask runs whatever task a client submits under whatever key it names, and the first task
under a key is the key's for good: a second tenant who learns a block key (Dask's own
worker pages list full keys) could wait for the block to be evicted, submit a task under
the key returning its own tensors, and have the owner's next lookup, acquire or resume
read them. So every key of ours carries its namespace's tag (``keys.namespace_tag``), and
every new task of a graph under a KV key pattern (``keys.is_kv``) passes here first, in
the plugin's ``update_graph`` hook, before Dask schedules anything:

* it must come from a client holding a live session whose namespace owns the key's tag -
  the session is found by the client stream the graph came on
  (``dask_internals.current_connection``), never by a name or a token in the graph;
* a key the catalog lists for another namespace is refused;
* its ``kv`` annotation, if any, must pass ``kv_notes`` (a block's names its own key);
* a task whose value holds K/V (``keys.holds_kv``) either declares the KV it adds (a
  compute annotation's ``kv_out``, a block's ``nbytes``: admission reserves them and
  ``kv_declared`` holds the result to them) or is cut from a KV output of its namespace it
  depends on (a branch, a replica: it shares that output's tensors). Anything else would
  add KV no admission saw.

The check fails closed: whatever it raises (a ``ValueError`` naming a field, or anything
else - ``10**400`` once made a check raise ``OverflowError``) refuses the task. A refused
task errs with one ``AccessDenied`` line for its client and is forgotten at once
(``dask_internals.refuse_new_tasks``): nothing of it runs, and its key stays free for the
task its owner submits. Data put under a KV key without a task (``Client.scatter``) is
refused too (``refused_data``). With no tenants configured (one trust domain) only the
annotation is checked; a task without a session then runs uncataloged, as it always did.

What this part keeps: which namespace's accepted task computes each KV key Dask holds
(``owner``), so lookups and acquires hand out only keys their own namespace computed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from daskflow_kv import dask_internals as di
from daskflow_kv.keys import holds_kv, is_kv, is_output, short_key, tag_of
from daskflow_kv.state.catalog import KVCatalog

from .kv_notes import BlockNote, ComputeNote, parse_note
from .tenants import AccessDenied, Session, TenantRegistry


@dataclass(frozen=True, slots=True)
class Admitted:
    """A new KV task that may run, and for whom."""

    session: Session | None  # whose task it is (None: an open scheduler's client without a session)
    note: ComputeNote | BlockNote | None  # its checked annotation, if it had one


def cut_from_output(ts) -> bool:
    """``ts`` reads a KV output of its own namespace (a prefill's or a store load's): a block,
    branch or replica cut from it shares its tensors."""
    tag = tag_of(ts.key)
    return any(is_output(d.key) and tag_of(d.key) == tag for d in ts.dependencies)


class KeyOwnership:
    __slots__ = ("_scheduler", "_tenants", "_catalog", "_owner")

    def __init__(self, scheduler, tenants: TenantRegistry, catalog: KVCatalog):
        self._scheduler = scheduler  # the tasks a graph made
        self._tenants = tenants  # sessions by connection; open or not
        self._catalog = catalog  # which namespace a cataloged block is
        self._owner: dict = {}  # KV key -> namespace whose admitted task computes it (None: no session, open)

    def owner(self, key) -> str | None:
        """The namespace whose task computes ``key`` now (None: none admitted, or open without a session)."""
        return self._owner.get(key)

    def computed_by(self, key, namespace: str) -> bool:
        """``key`` is computed by an admitted task of ``namespace``."""
        return key in self._owner and self._owner[key] == namespace

    def forget(self, key) -> None:
        """Dask forgot ``key``: a new task under it is checked again."""
        self._owner.pop(key, None)

    def unchecked(self, task_keys) -> list:
        """The new KV tasks of a graph: the ones ``admit_graph`` checks (and the ones refused
        if checking the graph fails)."""
        tasks = self._scheduler.tasks
        return [k for k in task_keys if is_kv(k) and k not in self._owner
                and k in tasks and tasks[k].run_spec is not None]

    def refuse(self, keys, why: AccessDenied, stimulus_id: str) -> None:
        """Refuse tasks of the graph being added (nothing of them runs; their keys stay free)."""
        for k in keys:
            self._owner.pop(k, None)
        di.refuse_new_tasks(self._scheduler, keys, why, stimulus_id)

    def admit_graph(self, task_keys, notes: dict, stimulus_id: str) -> dict:
        """Check every new KV task of a graph; refuse those that fail. -> key: ``Admitted``.

        Call from ``update_graph``, on the connection the graph came on. Tasks the graph
        only refers to (admitted before) are not checked again.
        """
        connection = di.current_connection()
        tasks = self._scheduler.tasks
        admitted, refused = {}, defaultdict(list)
        for key in self.unchecked(task_keys):
            session = self._tenants.session_for(connection, key)
            try:
                self._check(key, session)
                note = None if key not in notes else parse_note(key, notes[key])
                self._check_declared(tasks[key], note)
            except (ValueError, AccessDenied) as e:
                refused[str(e)].append(key)
                continue
            except Exception as e:  # noqa: BLE001 -- fail closed: a check that breaks refuses
                refused[f"task {short_key(key)} refused: its kv annotation could not be checked "
                        f"({type(e).__name__})"].append(key)
                continue
            admitted[key] = Admitted(session, note)
        for why, keys in refused.items():
            di.refuse_new_tasks(self._scheduler, keys, AccessDenied(why), stimulus_id)
        admitted = {k: a for k, a in admitted.items() if k in tasks}  # not gone with a refused dependency
        for key, a in admitted.items():
            self._owner[key] = None if a.session is None else a.session.namespace
        return admitted

    def _check(self, key, session: Session | None) -> None:
        if self._tenants.open:
            return
        owner = self._tenants.namespace_of_key(key)
        if session is None:
            whose = f"namespace {owner!r}" if owner else "no configured namespace"
            raise AccessDenied(f"task {short_key(key)} refused: its key belongs to {whose} and this client holds "
                               "no session of it (only a namespace's own tasks compute its keys)")
        listed = self._catalog.namespace_of(key)
        if listed is not None and listed != session.namespace:
            raise AccessDenied(f"task {short_key(key)} refused: the key is cataloged for another namespace")

    def _check_declared(self, ts, note) -> None:
        """A task whose value holds K/V declares it, or shares a KV output's (tenants only:
        one trust domain needs no proof of what it adds)."""
        if self._tenants.open or not holds_kv(ts.key) or isinstance(note, (ComputeNote, BlockNote)):
            return  # a block declares its bytes: admitted on them unless it is a cut (kv_scheduler)
        if not cut_from_output(ts):
            raise AccessDenied(f"task {short_key(ts.key)} refused: a task under a KV key either declares the KV it "
                               "adds (a compute annotation with kv_out) or is cut from a KV output of its namespace "
                               "it depends on")

    def refused_data(self, keys) -> AccessDenied | None:
        """Data under KV keys may enter only as their task's result (``guard_data_handlers``)."""
        ours = [k for k in keys if is_kv(k)]
        if not ours:
            return None
        return AccessDenied(f"data under daskflow-kv keys ({short_key(ours[0])}) is refused: only a namespace's "
                            "own tasks compute its keys")
