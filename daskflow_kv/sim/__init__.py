"""A discrete-event simulation of a daskflow-kv cluster of N modeled workers. MODELED.

The simulator calls the same pure policy functions the runtime calls - imported from
``daskflow_kv.policy``, never copied - over workers whose prefill, decode-step, transfer and
store-read times come from a ``SimProfile`` (fitted from a bench results JSON, or a
hardware preset from public figures). One concept per file:

``profile``    what a modeled worker and link cost (fitted or preset);
``decode``     what a decode row costs, fitted on a bench run's measured decode timings;
``workload``   the arrivals and prompt shapes (exp 7's generator, or a JSON-lines trace);
``blocks``     chains of 64-token KV blocks and the per-worker ledgers that hold them;
``worker``     a modeled worker: a step loop (``policy.step_schedule``) on a virtual clock;
``loop``       the event loop (a heap of timed callbacks);
``systems``    daskflow-kv, ``local`` and text replay, as schedulers over modeled workers (a module each);
``report``     runs, metrics, the fidelity check and the JSON / markdown tables;
``repeatability`` two measurements of the same exp 7 rows side by side (the check's noise floor);
``ensemble``   each row replayed many times with measured step scatter, against every measurement of it;
``whatif``     a knob swept at one grid point, each system at its own best setting;
``plot``       the grid's figure (daskflow-kv / local throughput against workers).

Nothing here imports torch or distributed; exp 7's generator (``bench.load_stream``) is
imported lazily, only when a stream is generated rather than read from a trace.
"""

from .profile import PRESETS, SimProfile, fitted_profile, preset_profile
from .report import run_system, simulate_grid
from .workload import SimWorkflow, exp7_stream, read_trace, write_trace

__all__ = ["PRESETS", "SimProfile", "SimWorkflow", "exp7_stream", "fitted_profile", "preset_profile", "read_trace",
           "run_system", "simulate_grid", "write_trace"]
