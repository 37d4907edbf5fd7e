"""KV cache groups: which tokens each kind of attention layer still needs, and how layers form groups.

A hybrid model mixes attention types. Layers of one type (and window) form a KV cache group; every group
gets its own block table per sequence over ONE shared block pool of ONE block size (`hybrid.py`). What a
group keeps is decided by one function of a query position p, `first_needed(p)`: the first token a query
at p attends to.

    kind       first_needed(p)            a block [j*bs, (j+1)*bs) may be released when
    full       0                          never (the whole context is read)
    sliding    max(0, p - window + 1)     (j+1)*bs <= first_needed(num_computed)
    chunked    (p // window) * window     likewise (chunked-local attention, Llama 4 style)

`sliding` follows transformers' semantics: a query at p sees keys at positions > p - window. A prefix hit
at h (h tokens served from the cache) needs, in each group, the blocks covering [first_needed(h), h):
the whole prefix in a full group, the last window - 1 tokens in a sliding one.

Grouping layers (`group_layers`) follows vLLM's hybrid allocator: one page (block id) holds the KV of one
group's layers, so every group must have the same number of layers; with G = the fewest layers of any
attention type, each type's layers are cut into groups of G (the last one padded). A block's bytes are
then G layers' worth, whatever group holds it, and `padded_layers` says how many layer slots are padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt

from pagedkv.core.errors import InvalidArgumentError

IntOrArray = TypeVar("IntOrArray", int, npt.NDArray[np.int64])

GroupKind = Literal["full", "sliding", "chunked"]
GROUP_KINDS: tuple[GroupKind, ...] = ("full", "sliding", "chunked")


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """One KV cache group's attention: `full`, or `sliding`/`chunked` with a `window` in tokens."""

    kind: GroupKind = "full"
    window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GROUP_KINDS:
            raise InvalidArgumentError(f"group kind must be one of {GROUP_KINDS}, got {self.kind!r}")
        if self.kind == "full":
            if self.window is not None:
                raise InvalidArgumentError("a full-attention group has no window (pass window=None)")
        elif not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise InvalidArgumentError(f"a {self.kind} group needs a window: an int >= 1 tokens, got {self.window!r}")

    @property
    def is_full(self) -> bool:
        return self.kind == "full"

    def first_needed(self, position: IntOrArray) -> IntOrArray:
        """The first token a query at `position` attends to (see the module docstring); element-wise for
        an int array of positions."""
        if self.window is None:
            return position * 0
        if self.kind == "sliding":
            first = position - self.window + 1
            return first * (first > 0)
        return (position // self.window) * self.window

    def releasable_blocks(self, num_computed: IntOrArray, block_size: int) -> IntOrArray:
        """Leading blocks no query at or after `num_computed` reads (released as the window passes);
        element-wise for an int array of counts."""
        return self.first_needed(num_computed) // block_size

    def max_blocks_per_sequence(self, max_chunk_tokens: int, block_size: int) -> int | None:
        """The most blocks one sequence ever holds in this group when at most `max_chunk_tokens` tokens are
        computed per step (None: unbounded, a full group). The window's last tokens plus one chunk, plus one
        for alignment."""
        if self.window is None:
            return None
        return -(-(self.window - 1 + max_chunk_tokens) // block_size) + 1

    def label(self) -> str:
        return "full" if self.window is None else f"{self.kind}-{self.window}"


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """A KV cache group of a model: its spec and its layers (indices into the model's layers)."""

    spec: KVGroupSpec
    layers: tuple[int, ...]


def spec_of_layer(window: int | None, kind: str = "sliding") -> KVGroupSpec:
    return KVGroupSpec() if window is None else KVGroupSpec("chunked" if kind == "chunked" else "sliding", window)


def group_layers(windows: Sequence[int | None]) -> tuple[LayerGroup, ...]:
    """Layers (by their window, None = full attention) cut into equal-sized KV cache groups.

    Types appear in order of their first layer; a model with one attention type is one group of every
    layer. See the module docstring.
    """
    if not windows:
        raise InvalidArgumentError("a model needs at least one layer to group")
    by_type: dict[int | None, list[int]] = {}
    for i, w in enumerate(windows):
        if w is not None and (not isinstance(w, int) or w < 1):
            raise InvalidArgumentError(f"layer {i}: window must be None (full) or an int >= 1, got {w!r}")
        by_type.setdefault(w, []).append(i)
    size = min(len(layers) for layers in by_type.values())
    groups: list[LayerGroup] = []
    for window, layers in by_type.items():
        spec = spec_of_layer(window)
        groups += [LayerGroup(spec, tuple(layers[i : i + size])) for i in range(0, len(layers), size)]
    return tuple(groups)


def layers_per_block(groups: Sequence[LayerGroup]) -> int:
    """Layer slots one page holds: the size of the largest group."""
    return max(len(g.layers) for g in groups)


def padded_layers(groups: Sequence[LayerGroup]) -> int:
    """Layer slots that are padding across all groups (memory a page holds for no layer)."""
    per = layers_per_block(groups)
    return sum(per - len(g.layers) for g in groups)
