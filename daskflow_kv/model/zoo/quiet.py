"""Library chatter while loading or converting a model: off unless ``daskflow-kv.verbose``.

transformers draws a "Loading weights" bar on every ``from_pretrained`` (once per Dask
worker process), "Writing model shards" on ``save_pretrained``, and its GGUF reader a
per-tensor bar of its own (plain ``tqdm.auto``, outside transformers' switch). A run shows
one progress display of ours instead; ``daskflow-kv ... --verbose`` (or the setting, which
Dask hands to the workers of a LocalCluster) brings them back.
"""

from __future__ import annotations

import contextlib
import functools
import threading

from ... import config

_LOCK = threading.RLock()  # the switches are process-global: one quiet section at a time


@contextlib.contextmanager
def quiet_loading(gguf: bool = False):
    """transformers' progress bars off and its logs at ERROR inside the block (and, with
    ``gguf``, the GGUF reader's bar); restored afterwards. No-op when verbose."""
    if config.get("verbose"):
        yield
        return
    from transformers.utils import logging as hf_logging

    with _LOCK, contextlib.ExitStack() as stack:
        bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        stack.callback(hf_logging.set_verbosity, level)
        if bars:
            stack.callback(hf_logging.enable_progress_bar)
        if gguf:
            from transformers import modeling_gguf_pytorch_utils as reader

            bar = getattr(reader, "tqdm", None)
            if bar is not None:
                reader.tqdm = functools.partial(bar, disable=True)
                stack.callback(setattr, reader, "tqdm", bar)
        yield
