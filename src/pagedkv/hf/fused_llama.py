"""A fused forward for Llama-structured models: the same arithmetic as transformers' modules, fewer calls.

transformers runs a Llama layer as a tree of modules: two norms, q/k/v/o projections, rotary, the attention
function, gate/up/down projections, each a `Module.__call__` with its hooks and keyword plumbing. On a CPU,
where a small model's step is dominated by reading the weights and by that per-call overhead, `FusedLlama`
runs the packed step as one loop over the layers:

```
x = embed(ids)                                  [T, H]
cos, sin = rotary(positions)                     the model's own rotary module (every RoPE variant)
per layer:  h = rms_norm(x)
            q | k | v = h @ W_qkv                one GEMM over the concatenated q, k, v weights
            q, k = rope(q), rope(k)
            a = attend_layer(step, layer, q, k, v)   pagedkv.hf.attention: KV write + paged attention
            x = x + a @ W_o
            h = rms_norm(x)
            g | u = h @ W_gate_up                 one GEMM over the concatenated gate and up weights
            x = x + silu(g) * u @ W_down
logits = rms_norm(x)[rows] @ W_lm_head            only the rows that sample
```

Contract:
- `fuse_llama(model, backend)` returns a `FusedLlama` for a model whose layers are transformers' Llama
  modules (LlamaForCausalLM: SmolLM2, Llama 2/3, TinyLlama, ...) with SiLU, no sliding window, and None for any
  other model (the engine then runs transformers' forward).
- The concatenated weights are the model's storage: q/k/v and gate/up weights become views into them, so the
  model's own modules keep working (transformers' forward, `model.generate`) and no weight is held twice.
  With the "onednn" backend the fused GEMMs use oneDNN-packed copies (`pagedkv.hf.cpu_linear`), and the
  element-wise parts (norms with their residual adds, rotary, SiLU times up) run as three C calls a layer split
  over the torch threads (`pagedkv.hf.layer_ops`) where that extension is built; the "torch" backend keeps
  transformers' tensor operations. The "invariant" backend (batch-invariant mode, `pagedkv.hf.invariant`) runs
  the GEMMs on fixed 16-row tiles and attends every query token as its own decode row, so a request's logits do
  not depend on the rest of its batch; its element-wise C calls are per row, so they keep that.
- What the fused GEMMs hold apart from the model's storage (the packed copies, the concatenated biases) is
  taken from the weights when built and again by `refresh()`, which a weight update calls after writing new
  values into the model's parameters.
- On the "torch" backend, norms, rotary, activation and residuals are the same tensor operations transformers
  runs, in the same order; only the GEMMs over concatenated weights differ from separate ones, in summation
  order at most. The tests
  check greedy tokens and logits against transformers' forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.hf.attention import attend_layer
from pagedkv.hf.cache import PagedKVCache, PagedStep
from pagedkv.hf.layer_ops import LayerOps
from pagedkv.hf.step_metadata import StepBatch

if TYPE_CHECKING:
    from pagedkv.ops.options import AttentionOptions

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class _Layer:
    index: int
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    qkv_weight: torch.Tensor  # the concatenated q/k/v rows: the q/k/v projections' weights are views of it
    gate_up_weight: torch.Tensor


def fuse_llama(model: Any, backend: str = "torch") -> FusedLlama | None:
    """A `FusedLlama` over `model` (see the module docstring), or None where its layers are not Llama's."""
    if not _supported(model):
        return None
    return FusedLlama(model, backend)


def _supported(model: Any) -> bool:
    if type(model).__name__ != "LlamaForCausalLM" or not hasattr(model, "model"):
        return False
    cfg = model.config
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "sliding_window", None):
        return False
    layers = getattr(model.model, "layers", [])
    linears = ("q_proj", "k_proj", "v_proj", "o_proj")
    return bool(layers) and type(model.lm_head) is torch.nn.Linear and all(
        type(layer).__name__ == "LlamaDecoderLayer"
        and type(layer.self_attn).__name__ == "LlamaAttention"
        and type(layer.mlp).__name__ == "LlamaMLP"
        and all(type(getattr(layer.self_attn, n)) is torch.nn.Linear for n in linears)
        and all(type(getattr(layer.mlp, n)) is torch.nn.Linear for n in ("gate_proj", "up_proj", "down_proj"))
        for layer in layers
    )


class FusedLlama:
    """Runs one packed step of a Llama-structured model over pagedkv pages (see the module docstring)."""

    def __init__(self, model: Any, backend: str = "torch") -> None:
        from pagedkv.ops.options import attention_options

        self.model = model
        self.backend = backend
        body = model.model
        attn0 = body.layers[0].self_attn
        self.head_dim = int(attn0.head_dim)
        self.num_heads = int(model.config.num_attention_heads)
        self.num_kv_heads = int(model.config.num_key_value_heads)
        self.eps = float(body.norm.variance_epsilon)
        self.options: AttentionOptions = attention_options(float(attn0.scaling), None, None, None)
        if backend == "invariant":  # batch-invariant mode: each query token attends as its own decode row
            from pagedkv.hf.invariant import BatchInvariantOptions

            self.options = BatchInvariantOptions.of(self.options)
        self.layers = [
            self._build(layer, _concat_into(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                        _concat_into(layer.mlp.gate_proj, layer.mlp.up_proj))
            for layer in body.layers
        ]  # fmt: skip
        self.lm_head = self._linear(model.lm_head.weight, model.lm_head.bias)

    def refresh(self) -> None:
        """Take the fused GEMMs' weights from the model's parameters again (after new values were copied
        into them): the packed copies are packed anew, the concatenated biases built anew."""
        for i, (fused, layer) in enumerate(zip(self.layers, self.model.model.layers, strict=True)):
            self.layers[i] = self._build(layer, fused.qkv_weight, fused.gate_up_weight)
        self.lm_head = self._linear(self.model.lm_head.weight, self.model.lm_head.bias)

    def _build(self, layer: Any, qkv_weight: torch.Tensor, gate_up_weight: torch.Tensor) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return _Layer(
            index=int(attn.layer_idx),
            input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight,
            qkv=self._linear(qkv_weight, _concat_bias(attn.q_proj, attn.k_proj, attn.v_proj)),
            o=self._linear(attn.o_proj.weight, attn.o_proj.bias),
            gate_up=self._linear(gate_up_weight, _concat_bias(mlp.gate_proj, mlp.up_proj)),
            down=self._linear(mlp.down_proj.weight, mlp.down_proj.bias),
            qkv_weight=qkv_weight,
            gate_up_weight=gate_up_weight,
        )

    def _linear(self, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        if self.backend == "invariant":
            from pagedkv.hf.invariant import invariant_linear

            return invariant_linear(weight, bias)
        if self.backend == "onednn":
            from pagedkv.hf.cpu_linear import PackedLinear

            return PackedLinear(weight, bias)
        w, b = weight.detach(), None if bias is None else bias.detach()
        return lambda x: torch.nn.functional.linear(x, w, b)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # LlamaRMSNorm's operations, in its order (float32 statistics, back to the input dtype, then the weight)
        xf = x.to(torch.float32)
        variance = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.eps)
        return weight * xf.to(x.dtype)

    @torch.inference_mode()
    def __call__(self, cache: PagedKVCache, batch: StepBatch, batches: tuple[StepBatch, ...] | None = None) -> torch.Tensor:
        """The logits `[K, vocab]` of the rows `batch.logits_indices` selects, as `forward_step` returns them."""
        step = PagedStep(cache, batch, batches)
        body = self.model.model
        x = body.embed_tokens(batch.input_ids[0])  # [T, H]
        cos, sin = body.rotary_emb(x.unsqueeze(0), batch.position_ids)  # [1, T, D]
        ops = self._layer_ops(x) if self.backend != "torch" else None
        if ops is not None:
            return self._run_layer_ops(ops, step, batch, x, cos[0].contiguous(), sin[0].contiguous())
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, D]: broadcast over heads
        t, d = x.shape[0], self.head_dim
        nq, nkv = self.num_heads * d, self.num_kv_heads * d
        for layer in self.layers:
            qkv = layer.qkv(self._rms_norm(x, layer.input_norm))
            q = qkv[:, :nq].view(t, self.num_heads, d)
            k = qkv[:, nq : nq + nkv].view(t, self.num_kv_heads, d)
            v = qkv[:, nq + nkv :].reshape(t, self.num_kv_heads, d).contiguous()
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            a = attend_layer(step, layer.index, q, k, v, self.options)
            x = x + layer.o(a.reshape(t, nq))
            gate, up = layer.gate_up(self._rms_norm(x, layer.post_norm)).chunk(2, dim=-1)
            x = x + layer.down(torch.nn.functional.silu(gate) * up)
        x = self._rms_norm(x, body.norm.weight)
        return self.lm_head(x[batch.logits_indices])

    def _layer_ops(self, x: torch.Tensor) -> LayerOps | None:
        """The C element-wise calls for this step's rows (`pagedkv.hf.layer_ops`), or None (torch's operations)."""
        if x.device.type != "cpu" or not x.is_contiguous():
            return None
        return LayerOps.for_rows(
            x.shape[0], x.dtype, hidden=x.shape[1], heads=self.num_heads, kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, intermediate=self.layers[0].gate_up_weight.shape[0] // 2, eps=self.eps,
        )  # fmt: skip

    def _run_layer_ops(
        self, ops: LayerOps, step: PagedStep, batch: StepBatch, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """The layer loop with the element-wise parts in C: each residual add is fused into the next norm
        (`x += delta; h = norm(x)`), the last one into the model's final norm."""
        t, nq = x.shape[0], self.num_heads * self.head_dim
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.model.model.norm.weight]
        h = ops.norm(x, None, self.layers[0].input_norm)
        for layer, next_norm in zip(self.layers, norms, strict=True):
            q, k, v = ops.rope(layer.qkv(h), cos, sin)
            a = attend_layer(step, layer.index, q, k, v, self.options)
            h = ops.norm(x, layer.o(a.reshape(t, nq)), layer.post_norm)
            h = ops.norm(x, layer.down(ops.silu_mul(layer.gate_up(h))), next_norm)
        return self.lm_head(h[batch.logits_indices])


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _concat_into(*linears: torch.nn.Linear) -> torch.Tensor:
    """One weight tensor of the linears' weights stacked by rows; each linear's weight becomes a view of it."""
    fused = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = torch.nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


def _concat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([
        lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.weight.shape[0]) for lin in linears
    ])  # fmt: skip
