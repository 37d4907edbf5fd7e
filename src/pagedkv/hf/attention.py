"""The attention function pagedkv registers with transformers, and the calling convention around it.

transformers' attention modules compute Q, K, V (after RoPE, per layer) and hand them to the function
registered under `config._attn_implementation`, passing the forward's extra keyword arguments along. We
register `paged_attention_forward` as `"pagedkv"` and pass each step's `PagedStep` as the keyword
`pagedkv_step`. Per call and layer it:

1. writes the new tokens' K and V into the pages at `batch.slot_mapping` (`PagedStep.write`);
2. runs `pagedkv.ops.paged_attention` for the packed queries against each sequence's pages, causal, with the
   layer's sliding window and soft-cap as the module passes them (transformers' semantics: a query at
   position p sees keys at positions > p - window) and its attention sinks (`s_aux`, gpt-oss), one call per
   attention group of the batch (on CPU: the decode sequences together, each prefill chunk alone; see
   `pagedkv.hf.step_metadata`). The cache's `attention_backend` picks the implementation: `pagedkv.hf.sdpa`
   (block gather + torch SDPA, the CPU default) where it applies, `pagedkv.ops.paged_attention` otherwise
   (soft-cap, sinks, CUDA, or "ops");
3. returns `[1, T, num_heads, head_dim]`, the layout the module's output projection expects.

Per-step work happens once per step, not once per layer: the `PagedStep` built by `forward_step` holds the
write's checks and backend and, per attention group, the ops plan (`pagedkv.ops.plan`: validation,
dispatch, query tiles, split count) or the SDPA plan (gather ids, masks); every layer reuses them and only
launches its write and attention kernels. No CUDA graphs: capturing decode steps would remove the
remaining launch overhead, but without a GPU to verify a capture against eager execution they are left out.

No attention mask is built (transformers skips mask creation for attention functions without a registered
mask function), and the model runs with `use_cache=False`: the pages are the only cache.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pagedkv.core.errors import InvalidArgumentError
from pagedkv.hf.cache import PagedKVCache, PagedStep
from pagedkv.hf.invariant import BatchInvariantOptions, token_rows
from pagedkv.hf.model_spec import ModelSpec, UnsupportedModelError, model_spec
from pagedkv.hf.sdpa import paged_sdpa, sdpa_supports
from pagedkv.hf.step_metadata import StepBatch

if TYPE_CHECKING:
    from pagedkv.ops.options import AttentionOptions

ATTENTION_NAME = "pagedkv"
STEP_KWARG = "pagedkv_step"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query `[1, H, T, D]`, key/value `[1, Hkv, T, D]` for the
    packed new tokens; returns `([1, T, H, D], None)`. See the module docstring."""
    step = kwargs.get(STEP_KWARG)
    if not isinstance(step, PagedStep):
        raise InvalidArgumentError(
            f"attention {ATTENTION_NAME!r} needs the keyword {STEP_KWARG}=PagedStep(...) on the model call; "
            "run the model through pagedkv.hf.attention.forward_step"
        )
    _refuse_unsupported(module, query, kwargs, dropout)
    from pagedkv.ops.options import attention_options

    options = attention_options(scaling, sliding_window, softcap, kwargs.get("s_aux"))  # transformers' spelling, once
    # [1, H, T, D] -> [T, H, D]
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    return attend_layer(step, int(module.layer_idx), q, k, v, options).unsqueeze(0), None  # type: ignore[arg-type]


def attend_layer(
    step: PagedStep, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: AttentionOptions
) -> torch.Tensor:
    """One layer's paged attention for the step's packed tokens: write the new K/V (`[T, Hkv, D]`) at the
    step's slots, then attend with queries `[T, H, D]`; returns `[T, H, D]`. The attention function above and
    `pagedkv.hf.fused_llama` both call it."""
    kv_group, slot = step.cache.locate(layer_idx)  # hybrid models: the layer's KV cache group and page slot
    batch = step.batches[kv_group]
    step.write(layer_idx, k, v)
    if isinstance(options, BatchInvariantOptions):
        return _attend_rows(step, q, slot, options, kv_group)
    parts = [_attend_group(step, i, q, k, v, slot, options, kv_group) for i in range(len(batch.groups))]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _attend_group(
    step: PagedStep,
    i: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer_idx: int,
    options: AttentionOptions,
    kv_group: int = 0,
) -> torch.Tensor:
    """Attention of the step's attention group `i` (a run of decodes, or one prefill chunk) over KV cache
    group `kv_group`'s pages (`layer_idx` is the storage slot): SDPA over the paged KV where the backend and
    the group allow it, else `pagedkv.ops.paged_attention`."""
    from pagedkv.ops import attention as ops_attention  # on first call: `import pagedkv.hf` stays light

    g = step.batches[kv_group].groups[i]
    cache = step.cache
    q_g = q[g.token_start : g.token_end]
    kv_scales = cache.storage.layer_scales(layer_idx)
    if kv_scales is not None:  # quantized pages: read in place by kernels that dequantize (docs/quantized-kv.md)
        return _attend_quantized(step, i, q_g, layer_idx, options, kv_group, kv_scales)
    same_dtype = cache.storage.dtype == q_g.dtype  # else (KV stored in another dtype) pagedkv.ops upcasts
    if cache.attention_backend == "sdpa" and same_dtype and sdpa_supports(g.max_seqlen_q, g.seq_lens.shape[0], options):
        new = slice(g.token_start, g.token_end)  # the chunk's own K/V, for a prefill with no cached context
        return paged_sdpa(q_g, cache.layer_kv(layer_idx), step.sdpa_plan(i, kv_group), options, new_key=k[new],
                          new_value=v[new])  # fmt: skip
    key_cache, value_cache = cache.layer(layer_idx)
    plan = step.ops_plan(i, q_g, key_cache, value_cache, kv_group)  # holds the group's tables and lengths
    return ops_attention.run_planned(plan, q_g, key_cache, value_cache, options)


def _attend_rows(
    step: PagedStep, q: torch.Tensor, layer_idx: int, options: AttentionOptions, kv_group: int
) -> torch.Tensor:
    """Batch-invariant attention (`pagedkv.hf.invariant`): every packed query token is one decode row that
    reads its request's block table up to its own position, computed alone. The C decode kernel where it
    applies (one row per sequence, keys in order), else `attend_token_rows`."""
    from pagedkv.ops import cpu_decode

    cache = step.cache
    table, lens = token_rows(step.batches[kv_group])
    kv, kv_scales = cache.layer_kv(layer_idx), cache.storage.layer_scales(layer_idx)
    if options.soft_cap is None and options.sinks is None and cpu_decode.available(q, kv, kv_scales):
        return cpu_decode.decode_attention(q, kv, table, lens, options, scales=kv_scales)
    key_cache, value_cache = cache.layer(layer_idx)
    return attend_token_rows(q, key_cache, value_cache, table, lens, options, kv_scales=kv_scales)


def attend_token_rows(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    table: torch.Tensor,
    lens: torch.Tensor,
    options: AttentionOptions,
    *,
    kv_scales: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """`pagedkv.ops` attention of query rows `[R, H, D]`, row r a decode row over `table[r]` up to `lens[r]`,
    each row's result its own: Triton in one call with one KV split (a query tile is one row; its key tiles
    start at position 0), the reference one call per row (its key tile width follows the batch size)."""
    from pagedkv.ops.attention import run_planned
    from pagedkv.ops.plan import plan_attention

    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)

    def attend(i: int, j: int) -> torch.Tensor:
        plan = plan_attention(q[i:j], key_cache, value_cache, table[i:j], lens[i:j], cu[: j - i + 1],
                              max_seqlen_q=1, num_splits=1, backend=backend)  # fmt: skip
        if plan.backend != "triton" and j - i > 1:
            return torch.cat([attend(r, r + 1) for r in range(i, j)])
        return run_planned(plan, q[i:j], key_cache, value_cache, options, kv_scales=kv_scales)

    return attend(0, q.shape[0])


def _attend_quantized(
    step: PagedStep, i: int, q_g: torch.Tensor, layer_idx: int, options: AttentionOptions, kv_group: int,
    kv_scales: torch.Tensor,
) -> torch.Tensor:
    """Attention group `i` over quantized pages (codes + per-token-head scales): the C decode kernel for a
    float32 decode group on a CPU, else `pagedkv.ops` (reference or Triton), never a dequantized
    copy of the pages."""
    from pagedkv.ops import attention as ops_attention
    from pagedkv.ops import cpu_decode

    g = step.batches[kv_group].groups[i]
    kv = step.cache.layer_kv(layer_idx)
    if g.max_seqlen_q == 1 and sdpa_supports(1, 1, options) and cpu_decode.available(q_g, kv, kv_scales):
        return cpu_decode.decode_attention(q_g, kv, g.block_table, g.seq_lens, options, scales=kv_scales)
    key_cache, value_cache = step.cache.layer(layer_idx)
    plan = step.ops_plan(i, q_g, key_cache, value_cache, kv_group)
    return ops_attention.run_planned(plan, q_g, key_cache, value_cache, options, kv_scales=kv_scales)


def _refuse_unsupported(
    module: torch.nn.Module, query: torch.Tensor, kwargs: dict[str, Any], dropout: float
) -> None:
    name = type(module).__name__
    if query.shape[0] != 1:
        raise InvalidArgumentError(
            f"{ATTENTION_NAME}: expected one packed row (batch dim 1), got query {tuple(query.shape)}"
        )
    if getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError(f"{name} is not causal; pagedkv attention is causal only")
    if kwargs.get("position_bias") is not None:
        raise UnsupportedModelError(f"{name} adds a position bias (e.g. ALiBi); pagedkv attention has none")
    if kwargs.get("s_aux") is None and getattr(module, "sinks", None) is not None:
        raise UnsupportedModelError(f"{name} has attention sinks but does not pass them as s_aux (gpt-oss's way)")
    if dropout:
        raise UnsupportedModelError(f"{name}: attention dropout {dropout} (training mode); call model.eval()")
    if getattr(module, "layer_idx", None) is None:
        raise UnsupportedModelError(f"{name} has no layer_idx, so its pages cannot be found")


def register_attention() -> None:
    """Register `"pagedkv"` with transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)


def prepare_model(model: Any) -> ModelSpec:
    """Check `model` can be served, switch it to pagedkv attention and eval mode; return its KV spec."""
    spec = model_spec(model)
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    model.eval()
    return spec


@torch.inference_mode()
def forward_step(
    model: Any, cache: PagedKVCache, batch: StepBatch, batches: tuple[StepBatch, ...] | None = None
) -> torch.Tensor:
    """Run one packed step; return the logits `[K, vocab]` of the rows `batch.logits_indices` selects.
    A hybrid model's cache (`PagedKVCache.layer_map`) takes one batch per KV cache group in `batches` (the
    same tokens, each group's block table and slot mapping); `batch` is the first."""
    if model.config._attn_implementation != ATTENTION_NAME:
        raise InvalidArgumentError(
            f"model uses attention {model.config._attn_implementation!r}; call pagedkv.hf.prepare_model first"
        )
    out = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        use_cache=False,
        logits_to_keep=batch.logits_indices,
        **{STEP_KWARG: PagedStep(cache, batch, batches)},
    )
    logits: torch.Tensor = out.logits[0]
    return logits
