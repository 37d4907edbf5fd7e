"""`RedisTier`: block values in a shared Redis (or Valkey) store, through redis-py with hiredis.

One value per block under `pkv:v1:{fingerprint}:{key hex}` (see `keys.py`, `value.py`). Every batch verb is
one round trip: `lookup`/`contains` pipeline `TYPE` and `STRLEN` per key (a key of another Redis type under
the prefix is deleted like a corrupt value, counted in `failures["wrong_type"]`; a value whose length is not
the one every value of this layout has, an empty one included, is deleted, reported absent, and handed to
the store by `take_corrupt` to count as a "header" loss), `get` is one `MGET`, `put` one pipeline of
`SET NX` (a block already stored by another replica is left alone), `touch` one `TOUCH`, `remove` one `DEL`.
Every reply of a pipeline is read: under `maxmemory` with `noeviction` one batch of `SET NX` is written in
part (OK for some keys, OOM for the rest), and only the keys written are counted and announced; each key
refused counts in `failures` by its error code ("oom").
The client keeps a connection pool. The store runs its own eviction (e.g. `allkeys-lru`), so a chain may
have holes: `lookup` stops at the first missing key, and a key that `TYPE` saw but `MGET` no longer finds
is reported "evicted". A value whose header or checksum does not match is deleted and reported
"checksum". A socket timeout is reported "timeout", any other connection failure "error"; either is a miss
for every key of the call, never an exception to the engine. After `max_failures` failed calls in a row
every call is skipped (a miss, counted "backoff") for `backoff_s` seconds, then tried again: a dead store
costs the engine at most a few timeouts per back-off period, not seconds every step. `probe()` connects
once at start-up and says in one line why the store cannot be used (wrong password, no socket, a
database past the server's count); `status()` says why calls are skipped now.

Events describe the keys this tier reported stored (`reported`), as a set: `stored` when its `SET NX`
wrote a key (a key another replica wrote is that replica's to report), `removed` when a reported key is
deleted here or found gone. Redis evicts on its own (`allkeys-lru`) without telling anyone, so a reported
key found missing by any call (`contains`/`lookup`'s `TYPE`, `get`'s `MGET`) is reported `removed`
then; `audit()` checks every reported key in one round trip, for a replica that wants its view exact now.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from pagedkv.core.errors import InvalidArgumentError, PagedKVError
from pagedkv.tiers.events import Medium, TierEvent
from pagedkv.tiers.keys import store_key
from pagedkv.tiers.tier import Rows, Spill, check_rows
from pagedkv.tiers.value import BlockLayout, CorruptValueError, pack, unpack


class TierUnavailableError(PagedKVError):
    """A required remote tier cannot be used (`EngineConfig(remote_required=True)`); the message says why."""


def check_remote_url(url: object) -> str:
    """`url` if redis-py can read it as a remote store's address; else `InvalidArgumentError` in one line.
    Nothing connects."""
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
        raise InvalidArgumentError(f"remote_url must be redis://..., rediss://... or unix://..., got {url!r}")
    try:
        parts = urlsplit(url)
    except ValueError as err:  # a bracketed IPv6 host left open or not an address: redis://[::1/0
        raise InvalidArgumentError(
            f"remote_url {redact(url)!r} cannot be read: {err} (an IPv6 host is written redis://[::1]:6379/0)"
        ) from None
    if parts.scheme == "unix" and not parts.path:
        raise InvalidArgumentError(f"remote_url {url!r}: unix:// needs the socket's path (unix:///run/redis.sock)")
    if parts.scheme != "unix" and parts.path.strip("/") and not parts.path.strip("/").isdigit():
        raise InvalidArgumentError(f"remote_url {url!r}: the path must be a database number (redis://host:6379/0)")
    try:
        from redis.connection import parse_url
    except ImportError as err:  # pragma: no cover - the tiers extra installs it
        raise InvalidArgumentError("the remote tier needs redis-py: pip install 'pagedkv[tiers]'") from err
    try:
        parse_url(url)  # type: ignore[no-untyped-call]
    except ValueError as err:
        raise InvalidArgumentError(f"remote_url {redact(url)!r} cannot be read: {err}") from None
    return url


def redact(url: str) -> str:
    """The URL without its password (for messages), even one that cannot be parsed."""
    try:
        parts = urlsplit(url)
    except ValueError:
        scheme, sep, rest = url.partition("://")
        user_info, at, host = rest.rpartition("@")
        return f"{scheme}{sep}{user_info.split(':', 1)[0]}:***@{host}" if at and ":" in user_info else url
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


class RedisTier:
    medium: Medium = "REMOTE"

    def __init__(
        self, url: str, layout: BlockLayout, fingerprint: str, *, timeout_s: float = 2.0, client: Any = None,
        max_failures: int = 3, backoff_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        try:
            import redis
        except ImportError as err:  # pragma: no cover - the tiers extra installs it
            raise InvalidArgumentError(
                "the remote tier needs redis-py: pip install 'pagedkv[tiers]'"
            ) from err
        if client is None:
            check_remote_url(url)
        self._errors = redis.exceptions
        self.url = redact(url)
        self.layout = layout
        self.fingerprint = fingerprint
        self.client = client or redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=False
        )
        self.events: list[TierEvent] = []
        self.reported: set[bytes] = set()  # keys reported stored and not removed since
        self.failures: Counter[str] = Counter()  # calls that failed (and calls skipped: "backoff"), by reason
        self._corrupt: list[bytes] = []  # wrong-size values `contains` found and deleted (`take_corrupt`)
        self.round_trips = 0
        # back-off: after `max_failures` failed calls in a row, every call is skipped for `backoff_s`
        self.max_failures, self.backoff_s, self._clock = max_failures, backoff_s, clock
        self._failed_in_a_row = 0
        self._skip_until = 0.0
        self._last_error = ""

    def probe(self) -> str | None:
        """Connect once (`PING`): None when the store answers, else one line saying why it does not."""
        errors = self._errors
        try:
            self.client.ping()
        except errors.AuthenticationError as err:
            return f"authentication failed (wrong or missing password): {err}"
        except errors.ResponseError as err:
            if "DB index" in str(err) or "invalid DB" in str(err):
                return f"the database number is past the server's count: {err}"
            return f"the server refused the connection: {err}"
        except (errors.RedisError, OSError) as err:
            return f"cannot connect: {err}"
        return None

    def status(self) -> str | None:
        """None while the tier is in use; else why its calls are being skipped now (the back-off)."""
        if self._clock() < self._skip_until:
            left = self._skip_until - self._clock()
            return (f"skipped for {left:.0f} s more after {self.max_failures} failed calls in a row "
                    f"(last: {self._last_error})")  # fmt: skip
        return None

    def _k(self, key: bytes) -> bytes:
        return store_key(self.fingerprint, key)

    def _failure(self, err: Exception) -> str:
        reason = "timeout" if isinstance(err, self._errors.TimeoutError) else "error"
        self.failures[reason] += 1
        return reason

    def _refusal(self, err: Exception) -> str:
        """A command the server refused: "oom" (maxmemory reached with noeviction), "readonly", else "error"."""
        if isinstance(err, self._errors.OutOfMemoryError):
            return "oom"
        return "readonly" if isinstance(err, self._errors.ReadOnlyError) else "error"

    def _call(self, fn: Any) -> tuple[Any, str | None]:
        """One round trip, or a miss without one while backing off. A failure never raises; `max_failures`
        in a row start a back-off of `backoff_s` seconds, so a dead store costs no time every step."""
        if self._skip_until and self._clock() < self._skip_until:
            self.failures["backoff"] += 1
            return None, "backoff"
        self.round_trips += 1
        try:
            result = fn()
        except (self._errors.RedisError, OSError) as err:
            self._failed_in_a_row += 1
            self._last_error = f"{type(err).__name__}: {err}"
            if self._failed_in_a_row >= self.max_failures:
                self._skip_until, self._failed_in_a_row = self._clock() + self.backoff_s, 0
            return None, self._failure(err)
        self._failed_in_a_row, self._skip_until = 0, 0.0
        return result, None

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.type(self._k(k))
                pipe.strlen(self._k(k))  # a reply error (WRONGTYPE) for a key of another type
            return list(pipe.execute(raise_on_error=False))

        found, reason = self._call(run)
        if reason is not None:
            return [False] * len(keys)  # a failed call proves nothing gone: no event
        kinds = [t.decode() if isinstance(t, bytes) else "error" for t in found[0::2]]
        wrong = [k for k, t in zip(keys, kinds) if t not in ("string", "none")]
        if wrong:  # a hash, list, ... under our prefix: deleted like a corrupt value, not a permanent miss
            self.failures["wrong_type"] += len(wrong)
        # every value has one known size (header + key + payload): any other (empty, cut, grown) is unreadable
        sizes = [self.layout.value_bytes(len(self._k(k))) for k in keys]
        bad = [k for k, t, n, size in zip(keys, kinds, found[1::2], sizes) if t == "string" and n != size]
        self._corrupt.extend(bad)
        if wrong or bad:
            self.remove(wrong + bad)
        present = [t == "string" and n == size for t, n, size in zip(kinds, found[1::2], sizes)]
        self._gone([k for k, p in zip(keys, present) if not p])
        return present

    def take_corrupt(self) -> list[bytes]:
        """Keys whose value `contains`/`lookup` found of the wrong size (and deleted) since the last call:
        the store counts each as a loss ("header") and remembers it lost, like a corrupt value `get` meets."""
        corrupt, self._corrupt = self._corrupt, []
        return corrupt

    def lookup(self, keys: Sequence[bytes]) -> int:
        n = 0
        for present in self.contains(keys):
            if not present:
                break
            n += 1
        return n

    def get(self, keys: Sequence[bytes], out: Rows) -> list[str | None]:
        check_rows(self.layout, out, len(keys), "REMOTE get")
        if not keys:
            return []
        skeys = [self._k(k) for k in keys]
        values, reason = self._call(lambda: self.client.mget(skeys))
        if reason is not None:
            return [reason] * len(keys)
        reasons: list[str | None] = []
        corrupt: list[bytes] = []
        for i, (key, skey, value) in enumerate(zip(keys, skeys, values)):
            if value is None:
                reasons.append("evicted")
                self._gone([key])
                continue
            try:
                out[i] = unpack(self.layout, skey, value)
            except CorruptValueError as err:
                reasons.append(err.reason)
                corrupt.append(key)
                continue
            reasons.append(None)
        if corrupt:
            self.remove(corrupt)
        return reasons

    def put(self, keys: Sequence[bytes], values: Rows, stamps: Sequence[int] | None = None) -> Spill:
        check_rows(self.layout, values, len(keys), "REMOTE put")
        if not keys:
            return Spill(0, [], [], None)

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for i, k in enumerate(keys):
                pipe.set(self._k(k), pack(self.layout, self._k(k), np.ascontiguousarray(values[i])), nx=True)
            return list(pipe.execute(raise_on_error=False))  # one reply per key: a batch may succeed in part

        done, reason = self._call(run)
        if reason is not None:
            return Spill(0, [], [], None)
        stored = [k for k, ok in zip(keys, done) if ok is True]
        for reply in done:  # a key refused (e.g. OOM under maxmemory with noeviction) is not stored
            if isinstance(reply, Exception):
                self.failures[self._refusal(reply)] += 1
        for k in stored:  # a reported key written again was evicted unseen in between: still held, no event
            if k not in self.reported:
                self.reported.add(k)
                self.events.append(TierEvent("stored", k, self.medium))
        return Spill(len(stored), [], [], None)

    def remove(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.delete(self._k(k))
            return list(pipe.execute())

        gone, reason = self._call(run)
        if reason is not None:
            return 0
        removed = [k for k, n in zip(keys, gone) if n]
        self._gone(keys)  # deleted here, or already gone: either way no longer held
        return len(removed)

    def touch(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call(lambda: self.client.touch(*[self._k(k) for k in keys]))

    def audit(self) -> int:
        """Check every reported key (one pipelined `EXISTS`); those Redis evicted are reported removed.
        Returns how many were gone."""
        before = len(self.reported)
        self.contains(list(self.reported))
        return before - len(self.reported)

    def _gone(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            if k in self.reported:
                self.reported.discard(k)
                self.events.append(TierEvent("removed", k, self.medium))

    def take_events(self) -> list[TierEvent]:
        events, self.events = self.events, []
        return events

    def close(self) -> None:
        self.client.close()
