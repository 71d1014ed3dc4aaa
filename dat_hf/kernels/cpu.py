"""The compiled CPU kernels (float32) as dat_hf backends: relational attention, RoPE, the MLP's SwiGLU, a decoding
step's input projections.

Relational attention (`csrc/relational_attention.cpp`), backend `"cpu"`: flash-style, one block of 64 receivers at
a time with an online softmax over blocks of 256 senders; per block it computes the attention scores of every head,
the relations `rel_l = q_rel,l k_rel,l^T` once for all heads (`R d_r + h R` multiply-adds per pair, where fused
values cost `h (d_h + R d_r)`), and both aggregations, in L2-sized scratch: nothing `[q, kv]`-sized is stored.
Backward recomputes each block from the saved log-sum-exp:

    dP = dSymbols v^T + sum_l dRelations_l rel_l      D_i = <dSymbols_i, symbols_i> + <dRelations_i, relations_i>
    dS = P (dP - D)                                   d rel_l = sum_h P_h dRelations_h,l

A bool mask `[b|1, q|1, kv]` (padding, relational biases) applies per block, with the causal order where the op is
asked for both (the backend asks for causal order only without a mask: the mask rule of `masking_dat.AttentionMask`,
where a given mask is the whole graph). A decoding step
(one receiver per row, no gradients) is one op that also applies `W_r`, reading the packed cache in place. Matrix
products go to the BLAS inside PyTorch (`sgemm_`), element-wise work to `at::vec`. The ops are `torch.library`
operators with fake (meta) kernels and an autograd formula, so `torch.compile` graphs call them as opaque kernels.

RoPE and SwiGLU (`csrc/swiglu_rope.cpp`): one pass each way instead of PyTorch's 3-5 element-wise passes. The layer's
input projections for a few rows (`csrc/projections.cpp`, decoding): one op for all of them, which reads each weight
once, instead of one matrix-vector product per projection.
"""

import torch
from torch import nn
from transformers.activations import SiLUActivation

from .. import dual_attention
from ..kernel_hooks import register_kernel
from ..masking_dat import receiver_offset
from ..relational_attention import RELATIONAL_ATTENTION_FUNCTIONS, RelationalCall
from ..relational_attention import relational_output
from . import contracts, projections
from .autograd import relational_op_autograd
from .cpu_build import build_extension

_READY = [False]


def cpu_kernel_ready() -> bool:
    """Whether the kernels are loaded in this process (no side effects; safe inside `torch.compile`)."""
    return _READY[0]


def load_cpu_kernel() -> bool:
    """Build (once per machine) and load the kernels if needed, never while `torch.compile` traces; True when they
    are usable."""
    if _READY[0]:
        return True
    if torch.compiler.is_compiling() or not build_extension():
        return False
    _register_python_side()
    _READY[0] = True
    return True


def _register_python_side():
    """Fake (meta) kernels for tracing and the autograd formula of the forward op."""

    @torch.library.register_fake("dat_hf::relational_attention_forward")
    def _forward_fake(query, key, values, q_rel, k_rel, mask, causal, offset, scaling, relation_scaling):
        b, h, n, d = query.shape
        return query.new_empty(b, n, h, d), query.new_empty(b, n, h, q_rel.shape[2]), query.new_empty(b, h, n)

    @torch.library.register_fake("dat_hf::relational_attention_backward")
    def _backward_fake(grad_symbols, grad_relations, query, key, values, q_rel, k_rel, symbols, relations, lse,
                       mask, causal, offset, scaling, relation_scaling):
        return tuple(t.new_empty(t.shape) for t in (query, key, values, q_rel, k_rel))

    @torch.library.register_fake("dat_hf::relational_attention_decode")
    def _decode_fake(query, key, values, q_rel, k_rel, relation_proj, mask, scaling, relation_scaling):
        return query.new_empty(query.shape[0], 1, query.shape[1], query.shape[3])

    @torch.library.register_fake("dat_hf::multi_linear")
    def _multi_linear_fake(x, weights):
        return x.new_empty(x.shape[0], sum(weight.shape[0] for weight in weights))

    @torch.library.register_fake("dat_hf::symbolic_attention")
    def _symbolic_attention_fake(x, weight, bias, templates, library, heads, scale):
        return x.new_empty(x.shape)

    @torch.library.register_fake("dat_hf::dual_attention_decode")
    def _decoding_step_fake(x, in_weights, symbols, symbol_weight, symbol_bias, cos, sin, key_buffer, value_buffer,
                            length, relation_proj, o_s_weight, o_s_bias, o_r_weight, o_r_bias, heads, scalings,
                            symmetric):
        return x.new_empty(x.shape[0], o_s_weight.shape[0] + o_r_weight.shape[0])

    @torch.library.register_fake("dat_hf::decoder_layer_decode")
    def _layer_step_fake(x, *args):
        return x.new_empty(x.shape)

    @torch.library.register_fake("dat_hf::swiglu_forward")
    def _swiglu_fake(gate, up):
        return gate.new_empty(gate.shape)

    @torch.library.register_fake("dat_hf::swiglu_backward")
    def _swiglu_backward_fake(grad, gate, up):
        return gate.new_empty(gate.shape), up.new_empty(up.shape)

    @torch.library.register_fake("dat_hf::rope")
    def _rope_fake(x, cos, sin, transpose):
        return x.new_empty(x.shape)

    setup_context, backward = relational_op_autograd(torch.ops.dat_hf.relational_attention_backward)
    torch.library.register_autograd("dat_hf::relational_attention_forward", backward, setup_context=setup_context)


# ---- relational attention ----------------------------------------------------------------------------------------
def _kernel_layout(x):
    """Last dim contiguous and rows at least that wide (BLAS leading dimensions); a copy only when needed."""
    return x if x.stride(-1) == 1 and x.stride(-2) >= x.shape[-1] else x.contiguous()


def _kernel_mask(mask):
    """bool `[b|1, 1, q|1, kv]` (True = attend) -> the kernels' `[b|1, q|1, kv]` with a contiguous last dim (or
    None)."""
    if mask is None:
        return None
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        raise ValueError(f"the relational kernels take a bool [b|1, 1, q|1, kv] mask, got {mask.dtype} "
                         f"{list(mask.shape)}")
    mask = mask[:, 0]
    return mask if mask.stride(-1) == 1 else mask.contiguous()


def relational_attention_op(query, key, values, q_rel, k_rel, causal: bool, scaling: float, relation_scaling: float,
                            mask=None):
    """query `[b, h, q, d_h]`, key and symbol values `[b, h_kv, kv, d_h]` (GQA: h divisible by h_kv; values may be
    expanded over the batch), relation queries `[b, q, R, d_r]`, relation keys `[b, kv, R, d_r]`, all float32 on CPU;
    causal: receiver i sees senders j <= kv - q + i (the op takes the offset kv - q, `receiver_offset`); mask: None
    or bool `[b|1, 1, q|1, kv]` (True = attend; the op intersects it with causal order when both are given, so the
    backend, `cpu_relational_attention`, passes causal only without a mask, as the mask rule of
    `masking_dat.AttentionMask` says; a receiver without senders gets zeros) -> attended symbols `[b, q, h, d_h]`,
    attended relations `[b, q, h, R]` (scaled by `relation_scaling`). Differentiable."""
    symbols, relations, _ = torch.ops.dat_hf.relational_attention_forward(
        *(_kernel_layout(t) for t in (query, key, values, q_rel, k_rel)), _kernel_mask(mask), causal,
        receiver_offset(query.shape[2], key.shape[2]), scaling, relation_scaling)
    return symbols, relations


def relational_decode_op(query, key, values, q_rel, k_rel, relation_proj, scaling: float, relation_scaling: float,
                         mask=None):
    """One decoding step of the relational heads (no autograd): query `[b, h, 1, d_h]`, key and symbol values
    `[b, h_kv, kv, d_h]`, relation queries `[b, 1, R, d_r]`, relation keys `[b, kv, R, d_r]`, relation_proj (W_r)
    `[h, d_h, R]`, float32 on CPU; mask None or bool `[b|1, 1, 1, kv]` (True = attend; a row with no sender gets
    zeros) -> messages `[b, 1, h, d_h]`: `sum_j a_ij (s_j W_s + r(x_i, x_j) W_r)` per head."""
    return torch.ops.dat_hf.relational_attention_decode(
        *(_kernel_layout(t) for t in (query, key, values, q_rel, k_rel)), relation_proj.contiguous(),
        _kernel_mask(mask), scaling, relation_scaling)


def cpu_relational_attention(query, key, symbol_values, relation_queries, relation_keys, relation_proj, attention_mask,
                             spec, dropout=0.0, **kwargs):
    """The `"cpu"` backend (signature and outputs as `eager_relational_attention`; the mask a `KernelMask`, under the
    mask rule: a given mask alone decides, causal order only without one)."""
    symbol_values = symbol_values.expand(query.shape[0], -1, -1, -1)
    if query.shape[2] == 1 and not (torch.is_grad_enabled() and query.requires_grad):
        messages = relational_decode_op(query, key, symbol_values, relation_queries, relation_keys, relation_proj,
                                        spec.scaling, spec.relation_scaling, attention_mask.mask)
        return messages, None, None
    attended_symbols, attended_relations = relational_attention_op(
        query, key, symbol_values, relation_queries, relation_keys,
        attention_mask.is_causal and attention_mask.mask is None, spec.scaling, spec.relation_scaling,
        attention_mask.mask)
    return relational_output(attended_symbols, attended_relations, relation_proj), None, None


# what a `RelationalCall` carries of the config fields `contracts.FIELDS` rules on for the backend
CALL_FIELDS = {
    "relation_activation": lambda call: call.relation_activation,
    "symbol_retrieval": lambda call: "position_relative" if call.relative_symbols else "symbols per sender",
}


def supports_cpu(call: RelationalCall) -> str | None:
    """What the compiled CPU kernel runs: float32 on CPU (no autocast), the config fields `contracts.FIELDS` lets the
    backend compute (identity relations, symbols per sender), no attention dropout or weights, no mask or a bool one;
    the kernel builds (a C++ compiler is needed)."""
    if call.device != "cpu" or call.dtype != torch.float32 or call.autocast:
        return "the CPU kernel runs float32 on CPU (no autocast)"
    if call.output_attentions:
        return "it does not return attention weights (use 'eager')"
    why = contracts.declined_values("cpu_relational", {field: value(call) for field, value in CALL_FIELDS.items()})
    if why is not None:
        return f"the CPU kernel does not compute {why}"
    if call.dropout > 0:
        return "the CPU kernel has no attention dropout"
    if not call.mask.bool_or_none:
        return "the CPU kernel takes no mask or a bool [b|1, 1, q|1, kv] one"
    if not load_cpu_kernel():
        return ("the CPU kernel is not built (no C++ compiler, a failed build, DAT_HF_CPU_KERNEL=0, or inside "
                "torch.compile; see `python -m dat_hf.kernels status`)")
    return None


# ---- RoPE ---------------------------------------------------------------------------------------------------------
def rope_op(x, cos, sin, transpose: bool = False):
    """RoPE (rotate-half convention) in one pass (no autograd): x `[b, n, heads, d]` (a contiguous last dim, any other
    strides), cos, sin `[b|1, n, d]`, float32 on CPU -> contiguous `x cos + rotate_half(x) sin`; `transpose=True`
    applies the transposed rotation (the gradient w.r.t. x)."""
    return torch.ops.dat_hf.rope(x, cos.contiguous(), sin.contiguous(), transpose)


class RotaryFunction(torch.autograd.Function):
    """`apply_rotary` through the one-pass op, forward and backward (the gradient is the transposed rotation).
    x `[b, n, h, d]` (contiguous last dim), cos, sin `[b|1, n, d]` (no gradient)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return rope_op(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rope_op(grad if grad.stride(-1) == 1 else grad.contiguous(), cos, sin, transpose=True), None, None


def cpu_rotary(x, cos, sin):
    if torch.is_grad_enabled() and x.requires_grad:
        return RotaryFunction.apply(x, cos, sin)
    return rope_op(x, cos, sin)


def accepts_rotary(x, cos, sin) -> bool:
    b, n, _, d = x.shape
    return (
        x.device.type == "cpu" and x.dtype == cos.dtype == sin.dtype == torch.float32 and d % 2 == 0
        and x.stride(-1) == 1 and cos.shape == sin.shape and cos.dim() == 3
        and cos.shape[0] in (1, b) and tuple(cos.shape[1:]) == (n, d)
        and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
        and not torch.compiler.is_compiling() and load_cpu_kernel()
    )


# ---- the layer's input projections -------------------------------------------------------------------------------
def multi_linear_op(x, weights):
    """`cat([x @ w.T for w in weights], -1)` in one op (no autograd), for a few rows: x `[rows, d]`, weights
    `[out_i, d]`, contiguous float32 CPU tensors -> `[rows, sum of out_i]`."""
    return torch.ops.dat_hf.multi_linear(x, list(weights))


def cpu_fused_linear(linears, x):
    rows = x.reshape(-1, x.shape[-1])
    return multi_linear_op(rows.contiguous(), [linear._parameters["weight"] for linear in linears]).view(
        *x.shape[:-1], -1)


_PLAIN_TENSORS = (nn.Parameter, torch.Tensor)


def _plain_tensor(t) -> bool:
    """A plain (no subclass: quantized, distributed) contiguous float32 CPU tensor."""
    return type(t) in _PLAIN_TENSORS and t.is_cpu and t.dtype == torch.float32 and t.is_contiguous()


def accepts_fused_linear(linears, x) -> bool:
    """Decoding-sized inputs (fewer rows than `FUSED_PROJECTION_MIN_ROWS`, where the reference runs one matrix
    product per projection) without gradients, float32 on CPU, through plain bias-free linears whose weights are plain
    tensors (not quantized or distributed tensor subclasses). (Checked every decoding step of every layer: one pass.)"""
    if not (x.device.type == "cpu" and x.dtype == torch.float32
            and x.shape[:-1].numel() < projections.FUSED_PROJECTION_MIN_ROWS and load_cpu_kernel()):
        return False
    grad = torch.is_grad_enabled()
    if grad and x.requires_grad:
        return False
    for linear in linears:
        if not projections.is_plain_linear(linear):
            return False
        parameters = linear._parameters  # (`nn.Module.__getattr__` is slow)
        w = parameters["weight"]
        if not (parameters["bias"] is None and type(w) in _PLAIN_TENSORS and w.dtype == torch.float32
                and w.device.type == "cpu" and w.is_contiguous() and not (grad and w.requires_grad)):
            return False
    return True


# ---- sensory heads over a few receivers, each over the senders its mask allows -----------------------------------
def cpu_sdpa_rows(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=False, **kwargs):
    """`sensory_attention.sdpa_attention_forward` for one sequence of a few receivers with a bool mask, each receiver
    reading only the senders from the first to the last its mask allows (continuous batching's packed rows: a
    request's own keys among every request's), through the relational decoding op without relations. query
    `[1, h, q, d_h]`, key, value `[1, h_kv, kv, d_h]`, mask bool `[1, 1, q, kv]` -> (`[1, q, h, d_h]`, None)."""
    rows, kv, d = query.shape[2], key.shape[2], query.shape[3]
    no_relations = query.new_empty(rows, 1, 0, 1)
    out = relational_decode_op(query.transpose(0, 2), key.expand(rows, -1, -1, -1), value.expand(rows, -1, -1, -1),
                               no_relations, query.new_empty(rows, kv, 0, 1),
                               query.new_empty(query.shape[1], d, 0), d**-0.5 if scaling is None else scaling, 1.0,
                               attention_mask.transpose(0, 2))
    return out.transpose(0, 1), None


def accepts_sdpa_rows(module, query, key, value, attention_mask, scaling=None, dropout=0.0, is_causal=False,
                      **kwargs) -> bool:
    """One sequence of fewer than `FUSED_PROJECTION_MIN_ROWS` receivers with a bool `[1, 1, q, kv]` mask, float32 on
    CPU, without gradients or dropout."""
    return (isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool
            and attention_mask.dim() == 4 and attention_mask.shape[0] == attention_mask.shape[1] == 1
            and query.shape[0] == 1 and 1 <= query.shape[2] < projections.FUSED_PROJECTION_MIN_ROWS
            and query.is_cpu and query.dtype == key.dtype == value.dtype == torch.float32
            and key.shape[-1] == value.shape[-1] == query.shape[-1] and dropout == 0 and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and load_cpu_kernel())


# ---- symbolic attention ------------------------------------------------------------------------------------------
def cpu_symbolic_attention(module, hidden_states, library):
    """`symbol_retrieval.symbolic_attention` in one op (no autograd): the query projection, each head's softmax over
    the templates and its sum of the library, for a few rows. hidden_states `[b, n, d]` -> symbols `[b, n, d]`."""
    b, n, d = hidden_states.shape
    parameters = module.q_proj._parameters
    scale = module.scale if module.scale is not None else (d // module.num_heads) ** -0.5
    symbols = symbolic_attention_op(hidden_states.reshape(b * n, d).contiguous(), parameters["weight"],
                                    parameters["bias"], module.template_features, library, module.num_heads, scale)
    return symbols.view(b, n, d)


def symbolic_attention_op(x, weight, bias, templates, library, heads: int, scale: float):
    """Symbolic attention for a few rows in one op (no autograd): x `[rows, d]`, the query projection's weight
    `[d, d]` and bias `[d]` (or None), templates and library `[S, d]`, contiguous float32 CPU tensors -> symbols
    `[rows, d]`, per head `softmax(scale q_h templates_h^T) library_h` with `q = x W^T + b`."""
    return torch.ops.dat_hf.symbolic_attention(x, weight, bias, templates, library, heads, scale)


def symbolic_attention_reads(module) -> list:
    """What the op reads of a `SymbolicAttention`: its query projection, templates and own library."""
    parameters = module.q_proj._parameters
    return [parameters["weight"], parameters["bias"], module.template_features,
            *([module.symbol_library] if "symbol_library" in module._parameters else [])]


# the op's loops re-read the tables for each row, where the reference's matrix products share them: it takes at most
# this many rows (measured: 13 against 26 us at 1 row, 25 against 30 at 4, 45 against 33 at 8; d=128, 64 symbols), and
# one row over tables of more than `SYMBOLIC_TABLE_ELEMENTS_FOR_ROWS` elements (256 KB)
SYMBOLIC_OP_MAX_ROWS = 4
SYMBOLIC_TABLE_ELEMENTS_FOR_ROWS = 1 << 16


def accepts_symbolic_attention(module, hidden_states, library) -> bool:
    """Per call, for a module the op computes (`contracts.spec`): decoding inputs without gradients, or dropout in
    train mode, float32 on CPU (up to `SYMBOLIC_OP_MAX_ROWS` rows, one over tables of more than
    `SYMBOLIC_TABLE_ELEMENTS_FOR_ROWS` elements), and a plain contiguous float32 library."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or not contracts.runs("symbolic_attention", module,
                                                                                       hidden_states):
        return False
    rows = hidden_states.numel() // hidden_states.shape[-1]
    tables = module.template_features.numel()
    if rows > 1 and (rows > SYMBOLIC_OP_MAX_ROWS or tables > SYMBOLIC_TABLE_ELEMENTS_FOR_ROWS):
        return False
    return not (module.training and module.dropout > 0) and _plain_tensor(library) and load_cpu_kernel()


# ---- a dual-attention layer's decoding step -----------------------------------------------------------------------
def cpu_decoding_step(module, hidden_states, symbols, position_embeddings, sensory_plan, relational_plan, cache,
                      **kwargs):
    """`dual_attention.fused_decoding_step` in one op (`dual_attention_decode`): the input projections, RoPE, the
    symbol values, the new token written into the in-place cache layer's buffers, both head types over every cached
    token, both output projections -> (output `[b, 1, (h_s + h_r) d_h]`, None, None); None where the cache layer has
    no room (the layer then computes the step part by part)."""
    b, d = hidden_states.shape[0], hidden_states.shape[-1]
    layer = cache.layer(module.layer_idx)
    slots = layer.slots_for(b, 1, module.packed, hidden_states.dtype, hidden_states.device)
    if slots is None:
        return None
    out = decoding_step_op(hidden_states.reshape(b, d).contiguous(),
                           *_step_arguments(module, symbols, position_embeddings, slots))
    _appended(module, relational_plan, layer)
    return out.view(b, 1, -1), None, None


def _step_weights(module) -> list:
    """The weights `decoding_step_op` reads of the `DualAttention` `module`, in its order (see `_step_arguments`)."""
    sensory, relational = module.sensory, module.relational
    symbol_proj, o_r = relational._modules["symbol_proj"], relational._modules["o_proj"]
    o_s = sensory._modules["o_proj"]
    return [[linear._parameters["weight"] for linear in dual_attention.head_linears(
                sensory, relational, module.input_projections.projections)],
            symbol_proj._parameters["weight"], symbol_proj._parameters["bias"], relational._parameters["relation_proj"],
            o_s._parameters["weight"], o_s._parameters["bias"], o_r._parameters["weight"], o_r._parameters["bias"]]


def dual_attention_step_reads(module) -> list:
    """What the op reads of a `DualAttention` (`contracts.READS`)."""
    in_weights, *weights = _step_weights(module)
    return [*in_weights, *weights]


def _step_arguments(module, symbols, position_embeddings, slots) -> list:
    """The arguments of `decoding_step_op` after x, for the `DualAttention` `module` and the cache layer's `slots`
    (`InPlaceCacheLayer.slots_for`: key and value buffers, length)."""
    sensory, relational = module.sensory, module.relational
    in_weights, symbol_weight, symbol_bias, relation_proj, o_s_weight, o_s_bias, o_r_weight, o_r_bias = \
        _step_weights(module)
    cos = sin = None
    if position_embeddings is not None:
        cos, sin = (t.reshape(t.shape[0], -1).contiguous() for t in position_embeddings)
    return [in_weights, symbols.reshape(-1, symbols.shape[-1]).contiguous(), symbol_weight, symbol_bias, cos, sin,
            *slots, relation_proj, o_s_weight, o_s_bias, o_r_weight, o_r_bias,
            [sensory.num_heads, sensory.num_kv_heads, relational.num_heads, relational.num_kv_heads,
             relational.num_relations, relational.relation_dim],
            [sensory.scaling, relational.scaling, relational.relation_scaling], relational.symmetric_relations]


def _appended(module, relational_plan, layer):
    """After the op wrote one token into the in-place cache layer's buffers: the layer holds it, and the relational
    backend is recorded as the plan's."""
    layer.appended(1)
    relational = module.relational
    if relational.__dict__.get("relational_attention_backend") != relational_plan.name:
        relational.relational_attention_backend = relational_plan.name


def cpu_layer_step(layer, hidden_states, symbols, position_embeddings, sensory_plan, relational_plan, cache,
                   **kwargs):
    """`modeling_dat.fused_layer_step` in one op (`decoder_layer_decode`): a pre-norm decoder layer's RMSNorms,
    dual attention (as `cpu_decoding_step`), residuals and SwiGLU MLP. hidden_states `[b, 1, d]` -> `[b, 1, d]`;
    None where the cache layer has no room."""
    b, d = hidden_states.shape[0], hidden_states.shape[-1]
    attention = layer.dual_attn
    cache_layer = cache.layer(attention.layer_idx)
    slots = cache_layer.slots_for(b, 1, attention.packed, hidden_states.dtype, hidden_states.device)
    if slots is None:
        return None
    input_norm, post_norm, mlp_weights = _layer_weights(layer)
    out = layer_step_op(hidden_states.reshape(b, d).contiguous(), input_norm._parameters["weight"],
                        input_norm.variance_epsilon,
                        *_step_arguments(attention, symbols, position_embeddings, slots),
                        post_norm._parameters["weight"], post_norm.variance_epsilon, *mlp_weights)
    _appended(attention, relational_plan, cache_layer)
    return out.view(b, 1, d)


def _layer_weights(layer) -> tuple:
    """(input norm, post-attention norm, the MLP's gate, up and down weights) of a `DATDecoderLayer`."""
    modules = layer._modules
    mlp = modules["mlp"]._modules
    return (modules["input_layernorm"], modules["post_attention_layernorm"],
            [mlp[name]._parameters["weight"] for name in ("gate_proj", "up_proj", "down_proj")])


def layer_step_reads(layer) -> list:
    """What the op reads of a `DATDecoderLayer` (`contracts.READS`)."""
    input_norm, post_norm, mlp_weights = _layer_weights(layer)
    return [input_norm._parameters["weight"], post_norm._parameters["weight"], *mlp_weights,
            *dual_attention_step_reads(layer.dual_attn)]


def layer_step_op(x, input_norm, input_eps, *args):
    """One decoding step of a pre-norm decoder layer with a SwiGLU MLP (no autograd; see `csrc/projections.cpp`): x
    `[b, d]`, the input norm's weight and eps, `decoding_step_op`'s arguments after x, the post-attention norm's
    weight and eps, the gate, up and down weights -> `[b, d]`."""
    return torch.ops.dat_hf.decoder_layer_decode(x, input_norm, input_eps, *args)


def decoding_step_op(x, in_weights, symbols, symbol_weight, symbol_bias, cos, sin, key_buffer, value_buffer,
                     length: int, relation_proj, o_s_weight, o_s_bias, o_r_weight, o_r_bias, heads, scalings,
                     symmetric: bool):
    """One decoding step of a dual-attention layer (no autograd; see `csrc/projections.cpp`): x `[b, d]`, the fused
    input projections' weights, symbols `[b|1, d]`, cos, sin `[b|1, d_h]` or None, the in-place cache's buffers
    (written at slot `length`), W_r, the output projections; heads `[h_s, h_kv_s, h_r, h_kv_r, R, d_r]`, scalings
    `[sensory, relational, relation]` -> `[b, (h_s + h_r) d_h]`."""
    return torch.ops.dat_hf.dual_attention_decode(x, in_weights, symbols, symbol_weight, symbol_bias, cos, sin,
                                                  key_buffer, value_buffer, length, relation_proj, o_s_weight,
                                                  o_s_bias, o_r_weight, o_r_bias, heads, scalings, symmetric)


def accepts_decoding_step(module, hidden_states, symbols, position_embeddings, sensory_plan, relational_plan, cache,
                          **kwargs) -> bool:
    """Per call, for a module the op computes (`contracts.spec`): see `_takes_step`."""
    return (hidden_states.shape[1] == 1 and not torch.compiler.is_compiling()
            and contracts.runs("dual_attention_step", module, hidden_states)
            and _takes_step(module, hidden_states, symbols, position_embeddings, sensory_plan, relational_plan, cache,
                            **kwargs))


def accepts_layer_step(layer, hidden_states, symbols, position_embeddings, sensory_plan, relational_plan, cache,
                       **kwargs) -> bool:
    """Per call, for a layer the op computes (`contracts.spec`, which holds its dual attention's too): no dropout in
    train mode, and `_takes_step`."""
    return (hidden_states.shape[1] == 1 and not torch.compiler.is_compiling()
            and contracts.runs("layer_step", layer, hidden_states)
            and not (layer.training and layer.dropout.p > 0)
            and _takes_step(layer.dual_attn, hidden_states, symbols, position_embeddings, sensory_plan,
                            relational_plan, cache, **kwargs))


def _takes_step(module, hidden_states, symbols, position_embeddings, sensory_plan, relational_plan, cache,
                **kwargs) -> bool:
    """A step's inputs as the ops take them: one new token per row (float32 on CPU: `contracts.runs`), without
    gradients, returned weights or attention dropout in train mode, into a cache layer of the forward's `ForwardCache`
    that lets a kernel write a token itself (`slots_for`: `cache_dat.InPlaceCacheLayer`; its room is checked when the
    op runs); symbols and RoPE's cos and sin of one token, float32 on CPU; plans that are the automatic CPU ones
    (`sdpa` sensory heads, the `cpu` relational backend) over implicit masks (every cached token visible)."""
    if (cache is None or torch.is_grad_enabled() or kwargs.get("output_attentions")
            or (module.training and module.sensory.attention_dropout > 0)):
        return False
    if not (sensory_plan.name == "sdpa" and relational_plan.name == "cpu" and not relational_plan.per_request
            and sensory_plan.source.implicit and relational_plan.source.implicit):
        return False
    if getattr(cache.layer(module.layer_idx), "slots_for", None) is None:  # (a layer the op may write: in-place)
        return False
    if symbols is None or symbols.dtype != torch.float32 or symbols.shape[1] != 1 or not symbols.is_cpu:
        return False
    if position_embeddings is not None and not all(
            t.dtype == torch.float32 and t.is_cpu and t.shape[1] == 1 for t in position_embeddings):
        return False
    return load_cpu_kernel()


# ---- SwiGLU -------------------------------------------------------------------------------------------------------
def swiglu_op(gate, up):
    """`silu(gate) * up` in one pass (no autograd): float32 CPU tensors of one shape -> that shape."""
    return torch.ops.dat_hf.swiglu_forward(gate.contiguous(), up.contiguous())


def swiglu_backward_op(grad, gate, up):
    """Gradients of `silu(gate) * up` w.r.t. gate and up in one pass: float32 CPU tensors of one shape."""
    return torch.ops.dat_hf.swiglu_backward(grad.contiguous(), gate.contiguous(), up.contiguous())


def takes_swiglu_op(act_fn, gate, up) -> bool:
    """Whether `act(gate) * up` is SwiGLU on float32 CPU tensors in eager mode with the ops built."""
    return (
        up is not None and isinstance(act_fn, SiLUActivation) and gate.dtype == up.dtype == torch.float32
        and gate.device.type == "cpu" and not torch.compiler.is_compiling() and load_cpu_kernel()
    )


def register():
    """Register the CPU backend and kernels with the model files' registries."""
    RELATIONAL_ATTENTION_FUNCTIONS.register("cpu", cpu_relational_attention, supports_cpu, preferred_on=("cpu",))
    register_kernel("rotary", cpu_rotary, accepts_rotary)
    register_kernel("fused_linear", cpu_fused_linear, accepts_fused_linear)
    register_kernel("symbolic_attention", cpu_symbolic_attention, accepts_symbolic_attention)
    register_kernel("sdpa_attention", cpu_sdpa_rows, accepts_sdpa_rows)
    register_kernel("dual_attention_step", cpu_decoding_step, accepts_decoding_step)
    register_kernel("layer_step", cpu_layer_step, accepts_layer_step)
    contracts.READS.update(layer_step=layer_step_reads, dual_attention_step=dual_attention_step_reads,
                           symbolic_attention=symbolic_attention_reads)


__all__ = ["cpu_decoding_step", "cpu_layer_step", "cpu_relational_attention", "cpu_sdpa_rows", "cpu_symbolic_attention",
           "decoding_step_op", "layer_step_op",
           "symbolic_attention_op", "relational_attention_op", "relational_decode_op", "multi_linear_op", "rope_op",
           "swiglu_op", "swiglu_backward_op", "supports_cpu", "takes_swiglu_op", "register", "load_cpu_kernel",
           "cpu_kernel_ready"]
