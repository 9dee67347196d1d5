"""Text <-> token ids, the same way everywhere: no special tokens added, none decoded.

Both modes build prompts from text and must feed the model identical ids, so the engine and
the distributed runtime each hold one ``TextCodec`` over their tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True, slots=True)
class TextCodec:
    tokenizer: Any  # a Hugging Face tokenizer (the model's own)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens), skip_special_tokens=True)
