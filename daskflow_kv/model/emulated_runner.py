"""``EmulatedRunner``: what ``ModelRunner`` is to the rest of the system, for ``emulated:<profile>``.

Tasks, the step loop, the ``local`` baseline's engine and parallel materialize hold a
runner and read from it what a model is (fingerprint, tokenizer, block size, K/V shape,
position limit, EOS) and ask it to ``run`` or ``prefill_relayed``. This one has no weights:
its forward is ``emulated_forward.EmulatedForward`` (which the step loop drives through
``step_forward``), its tokens are a hash chain over the prompt, its steps sleep what the
profile prices them at.
"""

from __future__ import annotations

import hashlib
import json
import time

import torch

from .. import config
from ..state.blocks import aligned_floor
from ..state.fingerprint import Fingerprint, tokenizer_digest
from .emulated_forward import EmulatedForward, sleep_until
from .emulated_kv import SEED, chain, hashes_in, make_kv
from .emulated_profile import EmulatedProfile, load_profile
from .runner import RunMetrics, RunOutput
from .sampling import GREEDY, SamplingParams, choose
from .step_forward import Feed


class EmulatedRunner:
    """A model that is only a profile: see the module docstring."""

    model = None  # no weights: whatever needs them (the HF recipe) asks ``profile`` instead
    aligned_prefill = False  # its tokens do not depend on how a prompt is chunked
    device = torch.device("cpu")

    def __init__(self, profile: EmulatedProfile, tokenizer, block_size: int | None = None,
                 namespace: str | None = None):
        from .emulated_kv import word_tokens

        self.profile = profile
        self.tokenizer = tokenizer
        self.block_size = config.get("block-size", block_size)
        self.num_layers = profile.layers
        self.kv_heads, self.head_dim = profile.stored_heads  # what its blocks hold
        self.max_positions = profile.max_positions
        self.vocab_size = len(tokenizer)
        self.dtype = getattr(torch, profile.dtype)
        self.eos_ids: set[int] = set()  # answers run to their token limit: step counts are the profile's own
        self.words = word_tokens(tokenizer)
        shape = json.dumps({"layers": profile.layers, "kv": profile.stored_heads, "scale": profile.kv_scale})
        self.fingerprint = Fingerprint(
            model_id=profile.model, weights=profile.digest, config=hashlib.blake2b(shape.encode(), digest_size=12)
            .hexdigest(), tokenizer=tokenizer_digest(tokenizer), dtype=profile.dtype,
            rope=json.dumps({"max_position_embeddings": profile.max_positions}),
            namespace=config.get("namespace", namespace))

    @property
    def bytes_per_token(self) -> int:
        return self.profile.bytes_per_token

    def reusable(self, reused: int) -> int:
        return reused

    def step_forward(self) -> EmulatedForward:
        """The forward a step loop over this runner drives (``packed_forward.forward_for``)."""
        return EmulatedForward(self)

    def run(self, prefix_blocks: list[torch.Tensor], prefix_len: int, new_tokens: list[int],
            max_new_tokens: int = 0, sampling: SamplingParams = GREEDY, stream: int = 0,
            return_logits: bool = False, export: bool = True) -> RunOutput:
        """``ModelRunner.run``: one request alone, its prompt in one step, then its decode steps."""
        if not new_tokens:
            raise ValueError("run needs at least one new token to feed")
        fw = EmulatedForward(self)
        m = RunMetrics(tokens_reused=prefix_len, tokens_computed=len(new_tokens))
        t0 = time.perf_counter()
        lane = fw.open(prefix_blocks, prefix_len, len(new_tokens) + max_new_tokens)
        t1 = time.perf_counter()
        [logits] = fw.run([Feed(lane, list(new_tokens), max_new_tokens > 0)])
        gen, generated, kept = sampling.generator(stream), [], []
        if max_new_tokens:
            generated.append(choose(logits, sampling, gen))
            kept.append(logits.clone())
        t2 = time.perf_counter()
        m.first_token_at = time.time()
        while generated and len(generated) < max_new_tokens:
            [logits] = fw.run([Feed(lane, [generated[-1]], True)])
            generated.append(choose(logits, sampling, gen))
            kept.append(logits.clone())
        t3 = time.perf_counter()
        blocks = fw.export(lane, aligned_floor(prefix_len, self.block_size), lane.length) if export else []
        m.tokens_generated = len(generated)
        m.load_s, m.prefill_s, m.decode_s, m.export_s = t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3
        return RunOutput(generated, lane.length, blocks, torch.stack(kept) if return_logits and kept else None, m)

    def prefill_relayed(self, prefix_blocks, prefix_len: int, start: int, new_tokens: list[int], recv, send
                        ) -> RunOutput:
        """``ModelRunner.prefill_relayed``: chunk [start, start + n) of a parallel prefill. Layer
        by layer it sleeps its share of the chunk's time, sends its own K/V of the layer to the
        later chunks and takes the earlier chunks' (real tensors, the same bytes a model's
        would be); the chain values of the earlier chunks come with their layer-0 keys, so a
        chunk can only continue the chain once those have arrived."""
        if not new_tokens:
            raise ValueError("a chunk needs at least one token")
        if start < prefix_len:
            raise ValueError(f"chunk start {start} lies inside the {prefix_len}-token prefix")
        n, p = len(new_tokens), self.profile
        m = RunMetrics(tokens_reused=prefix_len, tokens_computed=n)
        t0 = time.perf_counter()
        first = aligned_floor(start, self.block_size)
        lo = min(first, max(prefix_len - 1, 0))  # the chain is read from here on: its value before ``start`` too
        known = hashes_in(prefix_blocks, lo, prefix_len) if prefix_len else []
        t1 = time.perf_counter()
        per_layer = p.seconds({"prompt_rows": 1, "prompt_tokens": n, "prompt_attn": n * (start + n / 2)}) / p.layers
        heads, dim = p.stored_heads
        own, waited, clock = None, 0.0, t1
        for layer in range(p.layers):
            clock += per_layer
            sleep_until(clock)
            if layer == 0:  # the chain: the earlier chunks' layer-0 keys carry it
                if start > prefix_len:
                    w = time.perf_counter()
                    parts = recv(0)
                    waited += time.perf_counter() - w
                    known += hashes_in([k[0][None, None] for k, _ in parts], 0, start - prefix_len)
                hashes = chain(known[-1] if known else SEED, new_tokens)
                own = make_kv(1, heads, n, dim, self.dtype, hashes)[0]  # [2, heads, n, dim]
            if send is not None:
                send(layer, own[0][None], own[1][None])
            if start > prefix_len and layer > 0:
                w = time.perf_counter()
                recv(layer)  # the earlier chunks' K/V of this layer: real bytes, whose content the chain does not need
                waited += time.perf_counter() - w
                clock = max(clock, time.perf_counter())
        t2 = time.perf_counter()
        every = known[len(known) - (start - first):] if start > first else []
        blocks = EmulatedForward(self).export(_Chain(first, every + hashes), first, start + n)
        m.load_s, m.prefill_s, m.export_s = t1 - t0, t2 - t1, time.perf_counter() - t2
        m.relay_wait_s = waited
        return RunOutput([], start + n, blocks, None, m)


class _Chain:
    """Chain values from ``first`` on, shaped as an ``emulated_forward.Lane`` for ``export``."""

    def __init__(self, first: int, hashes: list[int]):
        self.first, self.hashes = first, hashes

    @property
    def length(self) -> int:
        return self.first + len(self.hashes)


def emulated_runner(model: str, block_size: int | None = None, namespace: str | None = None) -> EmulatedRunner:
    """The runner of ``emulated:<profile>``, with the tokenizer its profile names."""
    from .zoo.loader import load_tokenizer

    profile = load_profile(model)
    return EmulatedRunner(profile, load_tokenizer(profile.tokenizer), block_size, namespace)
