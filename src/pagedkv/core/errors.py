"""Typed errors for misuse, shared by every layer of pagedkv.

Three kinds of failure: a capacity shortfall is not an error (a call returns `None`/`False` and
changes nothing); misuse raises one of these with a message saying what to do; a broken internal invariant
raises `InvariantError` naming the component at fault.
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class InvalidArgumentError(PagedKVError, ValueError):
    """An argument has the wrong type, sign, shape or range."""


class UnknownSequenceError(PagedKVError, KeyError):
    """A sequence id that is not live (never admitted, or already freed)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown sequence"


class PinError(PagedKVError):
    """Unpinning a prefix that is not pinned, or pinning what is not cached."""


class CapacityError(PagedKVError):
    """A request that can never fit the configured capacity (not a transient shortfall)."""


class NotSupportedError(PagedKVError, NotImplementedError):
    """An operation this allocator does not implement (swapping on the contiguous manager)."""


class InvariantError(PagedKVError, AssertionError):
    """An internal invariant is broken: a bug in pagedkv. The message names the component."""


class EngineStateError(PagedKVError):
    """The engine is paused or asleep: it takes no request until `resume()` / `wake_up()` (HTTP 503)."""
