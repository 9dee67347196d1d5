"""``Delegate``: a façade attribute that one of its parts keeps.

``KVRuntime`` exposes what callers read (``rt.decisions``, ``rt.store``, ...) and the
what-if overrides they set (``rt.bandwidth_override = ...``), while the state itself is
declared where it is used (``rt.planner.decisions``). A ``Delegate`` names that place once,
instead of a property pair per attribute.
"""

from __future__ import annotations


class Delegate:
    __slots__ = ("path", "name", "settable")
    path: tuple[str, ...]  # attributes from the façade to the part that keeps it ("planner",)
    name: str  # the attribute on that part
    settable: bool  # whether callers may set it through the façade

    def __init__(self, where: str, settable: bool = False):
        *self.path, self.name = where.split(".")
        self.settable = settable

    def _part(self, obj):
        for step in self.path:
            obj = getattr(obj, step)
        return obj

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(self._part(obj), self.name)

    def __set__(self, obj, value) -> None:
        if not self.settable:
            raise AttributeError(f"{'.'.join((*self.path, self.name))} is read-only")
        setattr(self._part(obj), self.name, value)
