"""The engine's model lifecycle for RL rollouts: weight versions, pause / resume, sleep / wake_up.

An RL trainer (verl, OpenRLHF, slime) drives an engine in a loop: generate n samples per prompt, update
the weights, generate again, handing memory back in between. `Lifecycle` is that state machine; `Engine`
delegates its verbs here (`Engine.update_weights`, `pause`, `resume`, `sleep`, `wake_up`,
`reset_prefix_cache`) and every call runs between steps (the serving loop runs them on its engine thread).

```
           pause(abort|wait|keep)              sleep(1|2)
 serving  ───────────────────────>  paused   ────────────>  asleep (level 1: KV released; 2: weights too)
          <───────────────────────          <────────────
                  resume()                    wake_up()
 update_weights(source, version) runs in any state; requests in flight are parked and queued again
```

Invariants:

- KV computed under one weight version is never served under another, from any medium. `update_weights`
  (with `flush_cache=True`, the default) parks the requests in flight (their KV freed, as a recompute
  preemption), empties the device prefix cache and ends its epoch (O(1): every earlier key unmatchable,
  `pagedkv.core.prefix`), replaces the tiers below the device by empty ones keyed under a fingerprint that
  carries the version (`EngineTiering.renew`: another replica or a restart on other weights never hits the
  old entries in Redis), and the KV events say so (the tiers' keys `BlockRemoved`, then
  `AllBlocksCleared`). `flush_cache=False` keeps all of it: only where the caller states the weights did
  not change. Every `RequestOutput` carries the `weight_version` in force when it was taken.
- After new values are copied into the parameters, nothing the engine derived from the weights keeps old
  values: oneDNN-packed projections are packed anew (`PackedLinear.repack`, a tied one from the parameter
  it shares) and the fused forward takes its packed copies and concatenated biases again
  (`FusedLlama.refresh`), on every linear backend.
- A request that was in flight across an update keeps the tokens it had and recomputes its KV under the
  new weights before it samples again (its output reports the newer version).
- paused or asleep, the door refuses new requests with `EngineStateError` (HTTP 503); `pause("abort")`
  ends what is in flight now (finish_reason "abort", with the tokens it has); `pause("wait")` lets it
  finish; `pause("keep")` parks it (no KV held) until `resume()`.
- `sleep` needs nothing scheduled (pause first). Level 1 empties the prefix cache and releases the device
  KV pages (a draft model's too), the swap pool and the host / disk tiers; level 2 also releases the
  weights: to host memory on an accelerator, or dropped where they can be read again from a folder of
  safetensors that holds the version in force, and with them every oneDNN-packed copy (the model's
  projections and the fused forward's, `PackedLinear.release`). `wake_up` allocates them again (the KV
  pages zeroed, the caches empty, the copies packed from the weights read back).
- `pagedkv.core` stays torch-free: this module owns the torch side of the lifecycle.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.core.errors import EngineStateError, InvalidArgumentError, NotSupportedError
from pagedkv.events.wire import CPU, DISK, REMOTE
from pagedkv.hf.cpu_linear import PackedLinear, packed_linears

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import Engine
    from pagedkv.engine.request import Request

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_LEVELS = (1, 2)
WeightSource = Mapping[str, torch.Tensor] | str | os.PathLike[str]


@dataclass(frozen=True, slots=True)
class UpdateReport:
    """What `update_weights` did: the version now in force, tensors copied, seconds, whether KV was flushed."""

    weight_version: str
    num_tensors: int
    seconds: float
    flushed: bool
    num_parked: int  # requests in flight whose KV is recomputed under the new weights


@dataclass(frozen=True, slots=True)
class SleepReport:
    """What `sleep` gave back: bytes of KV (device pages, swap pool, host tier) and of weights released,
    the process's resident memory before and after, the device blocks emptied, the seconds it took."""

    level: int
    kv_bytes: int
    weight_bytes: int
    rss_before_bytes: int
    rss_after_bytes: int
    num_blocks: int
    seconds: float

    @property
    def rss_freed_bytes(self) -> int:
        return self.rss_before_bytes - self.rss_after_bytes


@dataclass(frozen=True, slots=True)
class WakeReport:
    level: int
    seconds: float
    rss_after_bytes: int


def rss_bytes() -> int:
    """This process's resident set size now (Linux /proc; 0 where it cannot be read)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Lifecycle:
    """One engine's weight version, pause mode and sleep level (see the module docstring)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.weight_version = "0"
        self.paused: str | None = None  # a PAUSE_MODES entry while paused
        self.sleep_level = 0
        self._parked: list[Request] = []
        self._renew_on_wake = False
        self._base_digest: str | None = None  # the weights' digest at the first update (tiers only)
        self._folder: tuple[Path, str] | None = None  # a folder that holds the weights of a version
        # what sleep released: (storage, its bytes, a host copy or None), KV pages then weights
        self._kv: list[tuple[Any, str, tuple[int, ...], torch.dtype, torch.device]] = []  # owner, attribute, ...
        self._weights: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]] = []

    # --- queries --------------------------------------------------------------------------------

    def refusal(self) -> str | None:
        """Why the door refuses new requests now (None: it takes them)."""
        if self.sleep_level:
            return f"the engine is asleep (level {self.sleep_level}); wake it up first (wake_up, POST /wake_up)"
        if self.paused is not None:
            return f"the engine is paused ({self.paused}); resume it first (resume, POST /resume)"
        return None

    def check_door(self) -> None:
        why = self.refusal()
        if why is not None:
            raise EngineStateError(why)

    @property
    def frozen(self) -> bool:
        """Paused in keep mode with requests parked: `step()` schedules nothing until `resume()`."""
        return self.paused == "keep" and any(not r.is_finished for r in self._parked)

    def state(self) -> dict[str, Any]:
        return {"weight_version": self.weight_version, "paused": self.paused, "sleep_level": self.sleep_level,
                "num_parked": len(self._parked)}  # fmt: skip

    # --- pause / resume -------------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> list[str]:
        """Close the door; `abort` ends every request in flight now (returns their ids; `step()` hands their
        outputs back), `wait` lets them finish, `keep` parks them until `resume()`."""
        if mode not in PAUSE_MODES:
            raise InvalidArgumentError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        if self.paused is not None and self.paused != mode:
            raise InvalidArgumentError(f"the engine is paused ({self.paused}) already; resume() before pausing as {mode}")
        engine = self.engine
        self.paused = mode
        ended: list[str] = []
        if mode == "abort":
            for rid, tracked in list(engine._tracked.items()):
                if tracked.parent_id is None and engine.finish(rid, "abort"):
                    ended.append(rid)
            for rid in sorted(engine.held_ids()):  # a sample group's, waiting for its leader's prompt
                if engine.finish(rid, "abort"):
                    ended.append(rid)
            self._parked = []
        elif mode == "keep":
            self._parked += engine.scheduler.park()
        return ended

    def resume(self) -> None:
        """Open the door again; requests parked by `pause("keep")` (or an update) are queued again."""
        if self.sleep_level:
            raise EngineStateError(f"the engine is asleep (level {self.sleep_level}); wake_up() before resume()")
        self.engine.scheduler.unpark(self._parked)
        self._parked = []
        self.paused = None

    # --- weights --------------------------------------------------------------------------------

    def update_weights(self, source: WeightSource, version: str | int | None = None, *, flush_cache: bool = True) -> UpdateReport:
        """Copy new weights into the model from a state dict (any subset of its parameter names) or a
        folder of safetensors (or one .safetensors file), then end every KV computed before (unless
        `flush_cache=False`: the caller states the weights did not change). `version` names the weights
        (default: the previous version + 1); a version must never name two different sets of weights,
        since replicas sharing a remote tier share its entries. Misuse changes nothing."""
        started = time.perf_counter()
        engine = self.engine
        new_version = self._next_version(version)
        folder = _folder_of(source)
        tensors = _read_tensors(source)
        self._check(tensors, full=bool(self._weights))
        if flush_cache and self.engine.tiering is not None and self._base_digest is None:
            from pagedkv.hf.loading import weights_digest

            model = engine.model
            self._base_digest = getattr(model, "pagedkv_weights_digest", None) or weights_digest(model)
        parked = engine.scheduler.park() if flush_cache else []
        self._restore_weights(load=False)
        self._copy(tensors)
        self.weight_version = new_version
        self._folder = (folder, new_version) if folder is not None else self._folder
        if flush_cache:
            self._flush(bump_epoch=True)
            if self.paused == "keep":
                self._parked += parked
            else:
                engine.scheduler.unpark(parked)
        return UpdateReport(new_version, len(tensors), time.perf_counter() - started, flush_cache, len(parked))

    def _next_version(self, version: str | int | None) -> str:
        if version is None:
            if not self.weight_version.isdigit():
                raise InvalidArgumentError(
                    f"the weight version {self.weight_version!r} is not a number: pass the next version explicitly"
                )
            return str(int(self.weight_version) + 1)
        if isinstance(version, bool) or not isinstance(version, str | int) or not str(version).strip():
            raise InvalidArgumentError(f"version must be a non-empty string or an int, got {version!r}")
        return str(version)

    def _check(self, tensors: Mapping[str, torch.Tensor], *, full: bool) -> None:
        """Every name is a parameter of the model and every shape its own (a released parameter: the shape
        it had). `full`: the weights were released (sleep level 2), so every parameter must be given (or
        tied to one that is)."""
        own: dict[str, Any] = self._targets()
        unknown = [n for n in tensors if n not in own]
        if unknown:
            raise InvalidArgumentError(
                f"update_weights: {len(unknown)} name(s) the model has no parameter for (first: {unknown[0]!r})"
            )
        for name, tensor in tensors.items():
            target = own[name]
            want = tuple(target.shape) if isinstance(target, torch.Tensor) else (target.out_features, target.in_features)
            if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != want:
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise InvalidArgumentError(f"update_weights: {name!r} is {got}, the model's is {want}")
        if full:  # a tied parameter is given with the one it shares its storage with
            own = dict(self.engine.model.named_parameters(remove_duplicate=False))  # a packed weight has no storage
            given = {(own[n].untyped_storage()._cdata, own[n].storage_offset()) for n in tensors if n in own}
            missing = [n for n, p in own.items() if (p.untyped_storage()._cdata, p.storage_offset()) not in given]
            if missing:
                raise InvalidArgumentError(
                    f"update_weights: the weights were released by sleep(level=2); give all of them "
                    f"({len(missing)} missing, first: {missing[0]!r})"
                )

    def _targets(self) -> dict[str, torch.Tensor | PackedLinear]:
        """What a weight name can be written into: the model's parameters, and the oneDNN-packed projections
        under the name of the weight each was packed from (`pagedkv.hf.cpu_linear.pack_linears`)."""
        model = self.engine.model
        return {**dict(model.named_parameters(remove_duplicate=False)), **packed_linears(model)}

    def _copy(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write `tensors` into the model, then refresh whatever was packed or fused from its weights: a
        packed projection is packed anew (a tied one from the parameter it shares), the fused forward's
        packed copies and concatenated biases are taken again (`FusedLlama.refresh`)."""
        own = self._targets()
        with torch.no_grad():
            for name, tensor in tensors.items():
                target = own[name]
                if isinstance(target, torch.Tensor):
                    target.data.copy_(tensor.to(target.device))
                elif target.tied_to is not None and isinstance(tied := own.get(target.tied_to), torch.Tensor):
                    tied.data.copy_(tensor.to(tied.device))  # one tensor: the tied parameter holds its values
                else:
                    target.repack(tensor)
            for name, target in own.items():  # a tied projection follows its parameter, whichever name was given
                if isinstance(target, PackedLinear) and target.tied_to is not None and (
                    name in tensors or target.tied_to in tensors
                ):
                    tied = own.get(target.tied_to)
                    if isinstance(tied, torch.Tensor):
                        target.repack(tied)
        fused = self.engine.runner.fused
        if fused is not None:
            fused.refresh()

    # --- sleep / wake ---------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> SleepReport:
        """Release the KV memory (level 1) and the weights too (level 2); see the module docstring."""
        if level not in SLEEP_LEVELS:
            raise InvalidArgumentError(f"sleep level must be 1 or 2, got {level!r}")
        if self.sleep_level:
            raise EngineStateError(f"the engine is asleep (level {self.sleep_level}) already; wake_up() first")
        engine = self.engine
        if engine.scheduler.has_unfinished():
            raise EngineStateError(
                "requests are in flight: pause('abort'), pause('keep'), or pause('wait') and let them finish, "
                "before sleep()"
            )
        drop_to: str | None = None
        if level == 2:
            drop_to = self._weights_plan()
        started, rss_before = time.perf_counter(), rss_bytes()
        num_blocks = int(engine.manager.num_blocks)
        self._flush()
        kv_bytes = self._release_kv()
        weight_bytes = self._release_weights(drop_to) if drop_to is not None else 0
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.sleep_level = level
        return SleepReport(level, kv_bytes, weight_bytes, rss_before, rss_bytes(), num_blocks,
                           time.perf_counter() - started)  # fmt: skip

    def wake_up(self) -> WakeReport:
        """Take back what `sleep` released: the weights (reloaded or moved back), then the KV pages."""
        if not self.sleep_level:
            raise EngineStateError("the engine is awake; wake_up() follows sleep()")
        started, level = time.perf_counter(), self.sleep_level
        self._restore_weights(load=True)
        for owner, name, shape, dtype, device in self._kv:  # the pages come back zeroed (scales: ones)
            fill = torch.ones if name.endswith("scales") else torch.zeros
            setattr(owner, name, fill(shape, dtype=dtype, device=device))
        self._kv = []
        if self.engine.draft is not None:
            self.engine.draft.restore()
        self.sleep_level = 0
        if self._renew_on_wake:  # the weights changed while asleep: the tiers' fingerprint follows
            self._renew_on_wake = False
            self._flush()
        return WakeReport(level, time.perf_counter() - started, rss_bytes())

    def _release_kv(self) -> int:
        """Release the device pages and the swap pool (each step reads them from their owners afresh; the
        steps that run before `wake_up` have nothing scheduled), and count the host tier's bytes (`_flush`
        released it)."""
        storage, cache = self.engine.cache.storage, self.engine.cache
        freed = 0
        for owner, name in ((storage, "data"), (storage, "scales"), (cache, "host"), (cache, "host_scales")):
            tensor = getattr(owner, name, None)
            if isinstance(tensor, torch.Tensor):
                freed += tensor.numel() * tensor.element_size()
                self._kv.append((owner, name, tuple(tensor.shape), tensor.dtype, tensor.device))
                setattr(owner, name, torch.empty(0, dtype=tensor.dtype, device=tensor.device))
        tiering = self.engine.tiering
        if tiering is not None:
            host = [t for t in tiering.store.local if type(t).__name__ == "HostTier"]
            freed += sum(int(t.num_blocks) for t in host) * tiering.store.layout.nbytes
        if self.engine.draft is not None:  # its pages and every draft sequence (pagedkv.engine.speculative.draft)
            freed += self.engine.draft.release()
        return freed

    def _weights_plan(self) -> str:
        """Where level 2 puts the weights: "host" (an accelerator's, to host memory) or "drop" (read again
        from the folder that holds the version in force); NotSupportedError where neither is possible."""
        model = self.engine.model
        plan = "host" if next(model.parameters()).device.type != "cpu" else "drop"
        if plan == "drop" and self._folder is None:  # the folder the model was loaded from, if never updated
            path = Path(str(getattr(model.config, "_name_or_path", "") or ""))
            if self.weight_version == "0" and path.is_dir() and any(path.glob("*.safetensors")):
                self._folder = (path, "0")
        if plan == "drop" and (self._folder is None or self._folder[1] != self.weight_version):
            raise NotSupportedError(
                f"sleep(level=2) on the CPU drops the weights and reloads them from a folder, but no folder holds "
                f"version {self.weight_version!r}; update_weights(<folder>) first, or sleep(level=1)"
            )
        if not all(p.untyped_storage().resizable() for p in model.parameters()):
            raise NotSupportedError("sleep(level=2): the weights' memory cannot be released (memory-mapped, or "
                                    "exported to numpy); use sleep(level=1)")  # fmt: skip
        return plan

    def _release_weights(self, drop_to: str) -> int:
        self._weights = _release(list(self.engine.model.parameters()), to_host=drop_to == "host")
        packed = sum(p.release() for p in self._packed_copies())  # repacked when the weights are read back
        return sum(nbytes for _, nbytes, _ in self._weights) + packed

    def _packed_copies(self) -> list[PackedLinear]:
        """Every oneDNN-packed copy of the weights: the model's projections (`pack_linears`) and the fused
        forward's GEMMs (`FusedLlama.refresh` packs them again)."""
        found = list(packed_linears(self.engine.model).values())
        fused = self.engine.runner.fused
        if fused is not None:
            for layer in fused.layers:
                found += [v for v in (getattr(layer, f.name) for f in fields(layer)) if isinstance(v, PackedLinear)]
            if isinstance(fused.lm_head, PackedLinear):
                found.append(fused.lm_head)
        return found

    def _restore_weights(self, *, load: bool) -> None:
        """Give released weights their storage again (copied back from host memory, or uninitialized); with
        `load`, fill the uninitialized ones from the folder that holds the version in force."""
        if not self._weights:
            return
        needs_load = _restore(self._weights)
        self._weights = []
        if load and needs_load and self._folder is not None:
            tensors = _read_tensors(self._folder[0])
            self._check(tensors, full=False)
            self._copy(tensors)

    # --- caches ---------------------------------------------------------------------------------

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix, on the device and in the host / disk tiers; returns the device keys
        dropped. Requests in flight keep their KV."""
        return self._flush()

    def _flush(self, *, bump_epoch: bool = False) -> int:
        """Empty the device prefix cache (`bump_epoch`: and end its epoch) and the tiers (renewed under the
        fingerprint of the version in force), reporting both in the KV events."""
        engine = self.engine
        tiering, events = engine.tiering, engine.kv_events
        if self.sleep_level:  # asleep: the tiers are empty and the pages gone; renewed at wake_up
            tiering, self._renew_on_wake = None, tiering is not None
        if tiering is not None:
            tiering.after_update()  # blocks published or evicted since the last step reach the tiers first
        if events is not None:
            events.poll()
            for log in events.logs:  # the tiers' copies go with the store they lived in
                for medium in (CPU, DISK, REMOTE):
                    keys = [k for k in log.holds(medium) for _ in range(log.copies(medium, k))]
                    if keys:
                        log.removed(medium, keys)
        if tiering is not None:
            tiering.take_events()  # what the event log did not take goes with the old store
            tiering.renew(engine.config, *self._fingerprint())
        feed = events.feed if events is not None else None
        if feed is not None and hasattr(feed, "reset"):
            dropped = int(feed.reset())
            if bump_epoch:
                feed.bump_epoch()
        else:  # no feed to report it (the contiguous baseline caches nothing and drops 0)
            dropped = int(engine.manager.reset_prefix_cache())
            if bump_epoch:
                engine.manager.bump_epoch()
        return dropped

    def _fingerprint(self) -> tuple[str, str]:
        """(model id, weights) for the tiers' fingerprint: the digest of the weights the engine started with,
        and after an update the version in force joined to it."""
        model = self.engine.model
        model_id = str(getattr(model.config, "_name_or_path", "") or self.engine.spec.model_type)
        if self._base_digest is not None:
            return model_id, f"{self._base_digest}@weights-version:{self.weight_version}"
        from pagedkv.hf.loading import weights_digest

        return model_id, getattr(model, "pagedkv_weights_digest", None) or weights_digest(model)


def _folder_of(source: WeightSource) -> Path | None:
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        return path if path.is_dir() else None
    return None


def _read_tensors(source: WeightSource) -> dict[str, torch.Tensor]:
    """The tensors of a state dict, a folder of .safetensors files or one .safetensors file."""
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, str | os.PathLike):
        raise InvalidArgumentError(
            f"update_weights takes a state dict or a folder of safetensors, got {type(source).__name__}"
        )
    from safetensors.torch import load_file

    path = Path(source)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path] if path.suffix == ".safetensors" else []
    if not path.exists() or not files:
        raise InvalidArgumentError(f"update_weights: {str(path)!r} is not a folder of .safetensors files nor one")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _release(tensors: list[torch.Tensor], *, to_host: bool) -> list[tuple[torch.UntypedStorage, int, torch.Tensor | None]]:
    """Shrink the storages under `tensors` (each once: tied and fused weights share one) to nothing, after
    copying their bytes to host memory if `to_host`; what `_restore` needs to give them back."""
    seen: dict[int, tuple[torch.UntypedStorage, int, torch.Tensor | None]] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        whole = torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage)
        kept = whole.to("cpu", copy=True) if to_host else None
        seen[storage.data_ptr()] = (storage, storage.nbytes(), kept)
    for storage, _, _ in seen.values():
        storage.resize_(0)
    return list(seen.values())


def _restore(released: list[tuple[torch.UntypedStorage, int, torch.Tensor | None]]) -> bool:
    """Give `_release`'s storages their bytes back; True if some came back uninitialized (no host copy)."""
    uninitialized = False
    for storage, nbytes, kept in released:
        storage.resize_(nbytes)
        if kept is None:
            uninitialized = True
            continue
        torch.tensor([], dtype=torch.uint8, device=storage.device).set_(storage).copy_(kept)
    return uninitialized
