"""What a stored block says about itself. Pure: no tensors, no I/O.

A store may be shared by tenants, so the manifest holds nothing a prompt can be read
back from: no token ids, no text. The key (HMAC-seeded per tenant, see
``state.blocks.keyed_digest``) names the block without revealing or allowing to guess its
tokens; the span, shape and dtype are what a reader checks the tensor against. The rest
(fingerprint digest, span, checksum) is sealed with the tensor for the tenant that wrote it
(see ``codec``): another tenant cannot read it.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, fields

from .. import keys

FORMAT = "daskflow-kv/block/v2"
KEY_RE = re.compile(rf"^{keys.BLOCK}-(?:[0-9a-f]{{{keys.TAG_HEX}}}-)?[0-9a-f]{{32}}$")  # state.blocks.block_key; also a safe file name


def check_key(key) -> str:
    """A block key, or ValueError: keys become object names, so nothing else gets in."""
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise ValueError(f"not a KV block key: {key!r}")
    return key


@dataclass(frozen=True, slots=True)
class BlockManifest:
    key: str  # content address; the object's name
    start: int  # position of the block's first token
    end: int  # one past its last token
    nbytes: int  # tensor bytes
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]  # [layers, 2, kv_heads, tokens, head_dim]
    checksum: str  # "crc32:<hex>" of the tensor bytes: verified on every read (see codec.checksum)
    fingerprint: str  # Fingerprint.digest: model, weights, tokenizer, dtype, rope, namespace
    created: float  # unix time the writer made the object
    format: str = FORMAT

    def to_json(self) -> str:
        d = asdict(self)
        d["shape"] = list(self.shape)
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> BlockManifest:
        """Parse and check a manifest; ValueError for anything malformed or of another format."""
        d = json.loads(text)
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} manifest")
        names = {f.name for f in fields(cls)}
        if set(d) != names:
            raise ValueError(f"manifest fields {sorted(d)} != {sorted(names)}")
        m = cls(**{**d, "shape": tuple(int(x) for x in d["shape"])})
        check_key(m.key)
        ints = (m.start, m.end, m.nbytes)
        if not all(type(x) is int for x in ints) or not 0 <= m.start < m.end or m.nbytes < 0:
            raise ValueError(f"manifest span/size out of range: start={m.start} end={m.end} nbytes={m.nbytes}")
        return m

    @property
    def tokens(self) -> int:
        return self.end - self.start
