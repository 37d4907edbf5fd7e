"""N-gram prompt lookup: propose the tokens that followed the latest earlier occurrence of the request's
last n tokens (vLLM's `ngram` method; its `prompt_lookup_min` / `prompt_lookup_max`).

Contract: `propose(token_ids, num_tokens)` looks at the whole sequence (prompt and output so far). For n
from `max_n` down to `min_n`, it searches the tokens before the final n for the same n tokens; the first n
with a match wins (longest match), and among its matches the latest one. It proposes up to `num_tokens`
tokens that followed that match, never fewer than one when it matched (a match always ends before the
last token, so at least one token follows it) and an empty list when nothing matches. Pure, cheap, torch-free.

```
tokens:   ... a b c X Y Z ... a b c        last n = 3 tokens "a b c"
                    ^^^^^ proposed (up to num_tokens)
```
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


class NgramProposer:
    """Prompt lookup over one request's tokens; see the module docstring."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int] | npt.NDArray[np.int64], num_tokens: int) -> list[int]:
        if num_tokens <= 0:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        length = len(arr)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = arr[length - n :]
            # candidate starts i with i + n <= length - 1: the match ends before the last token
            found = np.flatnonzero(arr[: length - n] == pattern[0])
            for j in range(1, n):
                if not len(found):
                    break
                found = found[arr[found + j] == pattern[j]]
            if len(found):
                start = int(found[-1]) + n
                return [int(t) for t in arr[start : start + num_tokens].tolist()]
        return []
