"""The systems simulated over modeled workers: daskflow-kv, ``local`` and text replay.

Each is a scheduler over the same ``ModeledWorker``s and runs a workflow level by level (the
executor's order): a level's agents that share leading segments form a prefix group.

``TextSystem``  text replay: every agent prefills its whole prompt on the least busy worker.
``LocalSystem`` the bench's ``local`` baseline: per-worker LRU prefix caches
                (``blocks.LRUCache``, as ``bench.local_engine``) behind a cache-aware router.
                The router is modeled here (``bench.router.CacheAwareRouter`` lives in the
                bench and compares token lists): the same finish estimate - queue + missing
                prefix prefill + ``policy.placement.batch_seconds`` - over block keys.
``DaskflowSystem`` daskflow-kv: the shared tier (a block directory any worker can fetch
                from), materialize placed by ``plan_placements`` under ``materialize_policy``, branches by
                ``plan_placements`` (earliest finish; transfer vs recompute from
                ``cost_model.decide``), and under a budget every task admitted by
                ``policy.admission.admit`` (evicting ``choose_victims``' blocks, or waiting).

Above ``full_pool`` workers a router or planner considers the workers holding the prefix
(daskflow-kv: its ``pool`` least busy holders) plus the ``pool`` least busy ones (the runtime
scores every worker; pruning keeps the simulation fast at 512 workers and changes nothing
at 2 or 8).
"""

from .base import System, prefix_groups
from .daskflow import DaskflowSystem
from .local import LocalSystem
from .text import TextSystem

__all__ = ["DaskflowSystem", "LocalSystem", "System", "TextSystem", "prefix_groups"]
