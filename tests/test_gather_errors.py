"""A task's error raised through ``plugin_client.gather`` leaves nothing of ours wanted.

Dask keeps a task's error in the future's state and re-raises that very object; the frames
it passes on the way up joined its traceback, and their futures stayed wanted for as long
as the client lived (a cycle rooted in the client: the 256 KiB chaos run's last workflow
waited for room that two clients' dead frames pinned). Played on a real in-process cluster;
a full garbage collection runs before each check (Dask's ``_gather`` leaves a cycle of its
own, which the collector frees; the one fixed here it could not).
"""

from __future__ import annotations

import ast
import gc
import traceback
from pathlib import Path

import pytest
from distributed import Client, LocalCluster

from daskflow_kv.errors import KVPreempted
from daskflow_kv.runtime.plugin_client import gather

from conftest import wait_until


def _preempted(x):
    raise KVPreempted(f"preempted {x}")


def _broken(x):
    raise ValueError(f"broken {x}")


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=1, processes=False, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as c:
        yield c


def _resume_like(client, fn, tag: str):
    """Hold a lease in this frame, as a resume holds its lookups, then gather a failing task."""
    lease = client.submit(lambda: b"kv", key=f"lease-{tag}", pure=False)
    branches = [{"held": lease}]  # noqa: F841 -- what the frame keeps, as Resumer.run's
    failing = client.submit(fn, tag, key=f"task-{tag}", pure=False)
    return gather(client, [failing])


@pytest.mark.parametrize("fn,kind", [(_preempted, KVPreempted), (_broken, ValueError)], ids=["preempted", "error"])
def test_a_raised_task_error_pins_nothing(client, fn, kind):
    tag = fn.__name__.strip("_")
    with pytest.raises(kind, match=f"{tag} {tag}") as info:
        _resume_like(client, fn, tag)
    # the copy raised keeps the task's own frames for the reader
    assert fn.__name__ in "".join(traceback.format_exception(info.value))
    del info
    gc.collect()
    assert wait_until(lambda: f"lease-{tag}" not in client.futures and f"task-{tag}" not in client.futures,
                      timeout=10), sorted(client.futures)


def test_without_the_copy_dask_keeps_the_frames(client):
    """The control: the same frames raising Dask's own object keep the lease wanted."""

    def resume_like():
        lease = client.submit(lambda: b"kv", key="lease-control", pure=False)
        branches = [{"held": lease}]  # noqa: F841
        return client.gather([client.submit(_broken, "control", key="task-control", pure=False)])

    with pytest.raises(ValueError):
        resume_like()
    gc.collect()
    assert not wait_until(lambda: "lease-control" not in client.futures, timeout=1)


# Waits on Dask futures in the runtime and the executor that do not go through ``gather``.
# Where a thread pool's or the step engine's own futures are waited on, that is no Dask future.
NOT_DASK = {"runtime/step_worker.py", "runtime/torch_threads.py"}


def test_every_wait_on_a_dask_future_goes_through_gather():
    pkg = Path(__file__).resolve().parent.parent / "daskflow_kv"
    bad = []
    for path in sorted([*(pkg / "runtime").glob("*.py"), *(pkg / "flow").glob("*.py")]):
        rel = path.relative_to(pkg).as_posix()
        if rel in NOT_DASK:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, owner = node.func.attr, node.func.value
                if name == "result" or (name == "gather" and not (isinstance(owner, ast.Name) and owner.id == "client"
                                                                  and rel == "runtime/plugin_client.py")):
                    bad.append(f"{rel}:{node.lineno} .{name}()")
    assert bad == [], "wait through plugin_client.gather: " + ", ".join(bad)
