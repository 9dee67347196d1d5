"""How many ``kv_*`` RPCs the plugin has answered, by name: the control plane's traffic,
counted where it enters the scheduler (issue 54's cost budget reads it; a client-side
count would miss calls that other clients or code paths make).

A handler is wrapped once, when the plugin installs it; the count is taken before the
handler runs, so a refused call counts too (it cost the scheduler a message all the same).
"""

from __future__ import annotations

import functools
import inspect
from collections import Counter


class RpcCounts:
    __slots__ = ("calls",)

    def __init__(self):
        self.calls: Counter[str] = Counter()  # RPC name -> calls answered (refused ones too)

    def counted(self, handlers: dict) -> dict:
        """``handlers`` (name -> handler), each counting its calls; async ones stay async (Dask
        awaits a coroutine function's result, runs a plain one inline)."""
        return {name: self._wrap(name, h) for name, h in handlers.items()}

    def _wrap(self, name: str, handler):
        calls = self.calls
        if inspect.iscoroutinefunction(handler):
            @functools.wraps(handler)
            async def counted_async(*args, **kwargs):
                calls[name] += 1
                return await handler(*args, **kwargs)
            return counted_async

        @functools.wraps(handler)
        def counted(*args, **kwargs):
            calls[name] += 1
            return handler(*args, **kwargs)
        return counted

    def snapshot(self) -> dict[str, int]:
        return dict(self.calls)
