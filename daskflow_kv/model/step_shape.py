"""What one forward step of the step loop fed, and how long it took: plain data.

The step loop keeps its last steps' shapes (``StepEngine.recent``) so that a step's cost can be
fitted on what steps really mixed - prompt chunks, decode rows of many requests, prefixes
copied in as requests join, blocks cut as they leave - instead of being added up from a
prefill profile and a decode profile measured apart (``benchmarks/step_cost.py``,
``sim.step_cost``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class StepShape:
    prompt_rows: int = 0  # requests that fed prompt tokens
    prompt_tokens: int = 0  # prompt tokens fed
    prompt_attn: float = 0.0  # sum over prompt rows of n (p + n/2): query-key pairs of their chunks
    decode_rows: int = 0  # requests that fed one generated token
    decode_keys: int = 0  # cached tokens those rows attend to, summed
    joined: int = 0  # requests that joined the batch this step
    loaded_tokens: int = 0  # prefix tokens copied in as they joined
    finished: int = 0  # requests that left with their output this step
    exported_tokens: int = 0  # tokens of the blocks cut for them
    seconds: float = 0.0  # the step's wall time, joins and exports included
    started: float = 0.0  # time.time() as it began: steps of a host's workers set side by side
    pool_rows: int = 0  # decode rows that attended in the lane pool at once (``step_cache._PoolRows``)...
    pool_slots: int = 0  # ...over this many slots (the span their slots cover, gaps included)...
    pool_width: int = 0  # ...each padded to this many keys (the longest row's)
    cpu: float = 0.0  # the step loop thread's CPU seconds in it: wall - cpu is time it waited for a core or the GIL

    def as_dict(self) -> dict:
        return asdict(self)
