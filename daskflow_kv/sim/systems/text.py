"""Text replay over modeled workers: no reuse, each agent's whole prompt on the least busy worker."""

from __future__ import annotations

from .base import System


class TextSystem(System):
    """Text replay: no reuse; each agent's whole prompt on the least busy worker."""

    name = "text"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        # predicted s sent to each worker and not finished, counted when sent: a worker's own
        # queue counts a request only once it arrives (a hop later), so a level's agents all
        # went to one worker, where the measured text replay spreads them over both
        self.sent = [0.0] * len(self.workers)

    def run_level(self, f, calls) -> None:
        for c in calls:
            w = min(self.workers, key=lambda w: (self.sent[w.idx], w.load, w.idx))
            n = c.prompt_tokens
            pred = w.prof.seconds(n) + max(0, c.max_new - 1) * w.prof.seconds(1, n)
            self.sent[w.idx] += pred
            self._request(w, n, 0, c.max_new, pred, lambda r, f=f, w=w, pred=pred: self._text_done(f, w, pred))

    def _text_done(self, f, w, pred) -> None:
        self.sent[w.idx] = max(0.0, self.sent[w.idx] - pred)
        self._call_done(f)
