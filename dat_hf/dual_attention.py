"""Dual attention: sensory (self-attention) heads beside relational heads, one implementation for every DAT model.

Relational attention (Altabaa & Lafferty, 2024), for receiver i and relational head h:

    A_i^h = sum_j a_ij^h (r(x_i, x_j) W_r^h + s_j W_s^h)
    a^h   = softmax((x W_q^h)(x W_k^h)^T / sqrt(d_h))                      (attention, with RoPE and GQA)
    r(x_i, x_j)_l = <x_i W_{q,l}^rel, x_j W_{k,l}^rel> / sqrt(d_r)        (l = 1..num_relations)

With the identity relation activation, sum_j a_ij r_l(x_i, x_j) = <q_l(x_i), sum_j a_ij k_l(x_j)>, so relational
heads are ordinary attention whose values are `[symbol values | relation keys]`: no `[b, n, n, R]` tensor is built,
fused SDPA kernels and the standard KV cache apply unchanged (the "fused" path). On CPU, relations are computed once
per pair for all heads instead: by a compiled flash-style kernel (fp32, no mask or a bool one, with a one-op decoding
step; `relational_kernel_cpu.py`) or, for additive masks and fp64, by the "tiled" path
(`TiledRelationalAttentionFunction`). Position-relative symbols and other relation activations use the "blocked" path:
explicit attention weights, one block of receivers at a time, symbols gathered per relative offset (never an
`[n, n, d]` tensor).
"""

from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicCache, DynamicLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .masking_dat import AttentionMask, additive_mask
from .relational_kernel_cpu import (cpu_kernel_ready, cpu_relational_attention, cpu_relational_decode, cpu_rope,
                                    load_cpu_kernel)

# receivers per block in the blocked path are chosen so one block's scores stay below this many elements
BLOCK_SCORE_ELEMENTS = 1 << 22


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x, cos, sin, heads_dim: int = 1):
    """RoPE: x `[b, h, n, d]` (or `[b, n, h, d]` with `heads_dim=2`), cos, sin `[b, n, d]` ->
    x cos + rotate_half(x) sin. With `heads_dim=2`, float32 on CPU in eager mode: one compiled pass each way."""
    if heads_dim == 2 and _takes_cpu_rope(x, cos, sin):
        if torch.is_grad_enabled() and x.requires_grad:
            return RotaryFunction.apply(x, cos, sin)
        return cpu_rope(x, cos, sin)
    cos, sin = cos.unsqueeze(heads_dim), sin.unsqueeze(heads_dim)
    return (x * cos) + (rotate_half(x) * sin)


def _takes_cpu_rope(x, cos, sin) -> bool:
    b, n, _, d = x.shape
    return (
        x.device.type == "cpu" and x.dtype == cos.dtype == sin.dtype == torch.float32 and d % 2 == 0
        and x.stride(-1) == 1 and cos.shape == sin.shape and cos.dim() == 3
        and cos.shape[0] in (1, b) and cos.shape[1:] == (n, d)
        and not (torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad))
        and not torch.compiler.is_compiling() and (cpu_kernel_ready() or load_cpu_kernel())
    )


class RotaryFunction(torch.autograd.Function):
    """`rotate(x, cos, sin, heads_dim=2)` through the compiled one-pass op, forward and backward (the gradient is the
    transposed rotation). x `[b, n, h, d]` (contiguous last dim), cos, sin `[b|1, n, d]` (no gradient)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return cpu_rope(x, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return cpu_rope(grad if grad.stride(-1) == 1 else grad.contiguous(), cos, sin, transpose=True), None, None


def apply_rotary_pos_emb(q, k, cos, sin):
    """q, k `[b, h, n, d]`; cos, sin `[b, n, d]`."""
    return rotate(q, cos, sin), rotate(k, cos, sin)


# fewer rows than this: the projections run one by one (concatenating their weights would cost more than it saves)
FUSED_PROJECTION_MIN_ROWS = 64


def _is_plain_linear(module) -> bool:
    return type(module) is nn.Linear and not (module._forward_hooks or module._forward_pre_hooks)


def fused_linear(linears, x):
    """`cat([linear(x) for linear in linears], -1)` as one matrix product over the concatenated weights (one GEMM
    forward, one per gradient backward, instead of one per projection). Wrapped projections (PEFT adapters, hooks such
    as DeepSpeed's parameter gathering, quantized or parametrized linears) and short inputs run one by one.
    x `[..., d]` -> `[..., sum of out_features]`."""
    if x.shape[:-1].numel() >= FUSED_PROJECTION_MIN_ROWS and all(map(_is_plain_linear, linears)):
        weight = torch.cat([linear.weight for linear in linears])
        bias = None
        if any(linear.bias is not None for linear in linears):
            bias = torch.cat([linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias
                              for linear in linears])
        return nn.functional.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])  # 2-d: one BLAS call per projection, no views around it (decoding is op-bound)
    return torch.cat([linear(rows) for linear in linears], dim=-1).view(*x.shape[:-1], -1)


class DATRotaryEmbedding(nn.Module):
    """RoPE in the rotate-half convention (the reference's interleaved pairs are permuted at conversion)."""

    def __init__(self, config):
        super().__init__()
        self.dim = config.head_dim
        self.base = config.rope_theta
        self.inv_freq = nn.Buffer(self.compute_inv_freq(), persistent=False)

    def compute_inv_freq(self):
        return 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.float) / self.dim))

    @torch.no_grad()
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """`[b, h_kv, n, d]` -> `[b, h_kv * n_rep, n, d]`."""
    if n_rep == 1:
        return hidden_states
    b, h, n, d = hidden_states.shape
    return hidden_states[:, :, None].expand(b, h, n_rep, n, d).reshape(b, h * n_rep, n, d)


def eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Softmax attention with explicit weights. query `[b, h, q, d]`, key `[b, h_kv, kv, d]`, value `[b, h_kv, kv,
    d_v]` (d_v may differ from d) -> output `[b, q, h, d_v]`, weights `[b, h, q, kv]`."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def attention_interface(config, output_attentions: bool) -> Callable:
    """The configured attention function; eager when weights are requested (fused kernels do not return them)."""
    if output_attentions:
        return eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)


def _kernel_mask(mask: AttentionMask, dtype, interface) -> torch.Tensor | None:
    """The mask in the format the kernel wants (eager needs an additive float mask)."""
    if interface is eager_attention_forward and mask.mask is not None and mask.mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.mask.device).masked_fill(~mask.mask, torch.finfo(dtype).min)
    if interface is eager_attention_forward and mask.mask is None and mask.is_causal:
        return "causal"  # resolved by the caller, who knows the lengths
    return mask.mask


def run_attention(module, config, query, key, value, mask: AttentionMask, output_attentions=False, **kwargs):
    """Attention through the Transformers interface with a DAT mask. Returns `[b, q, h, d_v]`, weights or None."""
    interface = attention_interface(config, output_attentions)
    kernel_mask = _kernel_mask(mask, query.dtype, interface)
    if isinstance(kernel_mask, str):
        kernel_mask = additive_mask(mask, query.shape[2], key.shape[2], query.dtype, query.device)
    out, weights = interface(
        module, query, key, value, kernel_mask,
        scaling=module.scaling, dropout=module.attention_dropout if module.training else 0.0,
        is_causal=mask.is_causal, **kwargs,
    )
    if mask.row_valid is not None:  # receivers without senders get a zero message (and report zero weights)
        out = out * mask.row_valid.transpose(1, 2).to(out.dtype)
        weights = None if weights is None else weights * mask.row_valid.to(weights.dtype)
    return out, weights


def _bool_mask_or_none(mask: AttentionMask) -> bool:
    """Whether the compiled kernels take this mask: none, or bool `[b|1, 1, q, kv]` (what sdpa masks are)."""
    return mask.mask is None or (mask.mask.dtype == torch.bool and mask.mask.dim() == 4 and mask.mask.shape[1] == 1)


class SensoryAttention(nn.Module):
    """Standard multi-head self-attention (GQA, RoPE) over the Transformers attention interface.

    `forward` takes q `[b, h, q, d_h]`, k, v `[b, h_kv, kv, d_h]` (projected, with RoPE, by `DualAttention`), attends
    and projects: -> output `[b, q, h * d_h]`, weights `[b, h, q, kv]` or None.
    """

    def __init__(self, config, layer_idx: int, is_causal: bool = True):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.num_heads = config.num_sensory_heads
        self.num_kv_heads = config.sensory_kv_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        d, hd = config.hidden_size, self.head_dim
        # with share_attention_params, queries and keys come from the relational heads' attention projections
        if not config.share_attention_params:
            self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
            self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * hd, self.num_heads * hd, bias=config.attention_out_bias)
        self.o_proj.residual_init = True

    def forward(self, query, key, value, mask: AttentionMask, output_attentions=False, **kwargs):
        out, weights = run_attention(self, self.config, query, key, value, mask, output_attentions, **kwargs)
        return self.o_proj(out.reshape(*out.shape[:2], -1)), weights


class RelationalAttention(nn.Module):
    """Relational attention heads: `A_i^h = sum_j a_ij^h (r(x_i, x_j) W_r^h + s_j W_s^h)`.

    `forward` takes the attention query `[b, h, q, d_h]` and key `[b, h_kv, kv, d_h]` (RoPE applied), symbol values
    (`[b, h_kv, kv, d_h]`, or the per-offset table `[2K + 1, h_kv, d_h]` for position-relative symbols; see
    `project_symbols`), relation queries `[b, q, R, d_r]` and relation keys `[b, kv, R * d_r]` (`DualAttention`
    projects them all), attends and projects: -> output `[b, q, h * d_h]`, attention weights `[b, h, q, kv]` and
    relations `[b, R, q, kv]` (both only when `output_attentions`).
    """

    def __init__(self, config, layer_idx: int, is_causal: bool = True):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_causal = is_causal
        self.num_heads = config.num_relational_heads
        self.num_kv_heads = config.relational_kv_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.head_dim = config.head_dim
        self.num_relations = config.relations
        self.relation_dim = config.relation_head_dim
        self.scaling = self.head_dim**-0.5
        self.relation_scaling = self.relation_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.relative_symbols = config.symbol_retrieval == "position_relative"
        self.max_relative_position = config.max_relative_position
        self.symmetric_relations = config.symmetric_relations
        self.relation_activation = config.relation_activation
        self.relation_act = ACT2FN[config.relation_activation] if config.relation_activation != "identity" else None
        d, hd, rd = config.hidden_size, self.head_dim, self.num_relations * self.relation_dim
        self.q_attn_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_attn_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)
        self.q_rel_proj = nn.Linear(d, rd, bias=False)
        if not config.symmetric_relations:
            self.k_rel_proj = nn.Linear(d, rd, bias=False)
        self.symbol_proj = nn.Linear(d, self.num_kv_heads * hd, bias=config.attention_bias)  # W_s
        self.relation_proj = nn.Parameter(torch.empty(self.num_heads, hd, self.num_relations))  # W_r [h, d_h, R]
        self.o_proj = nn.Linear(self.num_heads * hd, self.num_heads * hd, bias=config.attention_out_bias)
        self.o_proj.residual_init = True

    # CPU training and prefill: the compiled kernel (fp32, no mask or a bool one; `relational_kernel_cpu.py`), else the
    # tiled path (fp32/fp64, any mask; `tiled_relational_attention`)
    use_tiled_kernel: bool = True
    use_cpu_kernel: bool = True

    @property
    def uses_fused_path(self) -> bool:
        return self.relation_act is None and not self.relative_symbols

    def _cpu_path_eligible(self, query, output_attentions) -> bool:
        """What every CPU path (kernel, decode op, tiled) needs: fused-path heads, fp32/fp64 on CPU, no weights asked
        for, no autocast (it runs the matmuls in bf16: the fused path handles it), no attention dropout in training."""
        return (
            self.uses_fused_path and not output_attentions
            and query.device.type == "cpu" and query.dtype in (torch.float32, torch.float64)
            and not torch.is_autocast_enabled("cpu") and not (self.training and self.attention_dropout > 0)
        )

    @staticmethod
    def _cpu_kernel_loaded() -> bool:
        # under torch.compile only an already loaded kernel is used (building it is not traceable)
        return cpu_kernel_ready() or (not torch.compiler.is_compiling() and load_cpu_kernel())

    def _takes_cpu_kernel(self, query, mask: AttentionMask, output_attentions) -> bool:
        return (self.use_cpu_kernel and query.dtype == torch.float32 and query.shape[2] > 1 and _bool_mask_or_none(mask)
                and self._cpu_path_eligible(query, output_attentions) and self._cpu_kernel_loaded())

    def _takes_cpu_decode_kernel(self, query, mask: AttentionMask, output_attentions) -> bool:
        """One receiver per row without gradients (generation): the kernel's whole-step decode op (no mask, or a bool
        one such as left padding)."""
        return (self.use_cpu_kernel and query.dtype == torch.float32 and query.shape[2] == 1
                and _bool_mask_or_none(mask) and mask.row_valid is None and self.relation_proj.dtype == torch.float32
                and self._cpu_path_eligible(query, output_attentions)
                and not (torch.is_grad_enabled() and (query.requires_grad or self.relation_proj.requires_grad))
                and self._cpu_kernel_loaded())

    def _takes_tiled_path(self, query, key, output_attentions) -> bool:
        return (
            self.use_tiled_kernel and query.shape[2] > 1 and self._cpu_path_eligible(query, output_attentions)
            and query.shape[2] * key.shape[2] >= TILED_MIN_PAIRS and not torch.compiler.is_compiling()
        )

    def project_symbols(self, symbols, batch_size):
        """Symbol values `s_j W_s`: symbols `[b|1, n, d]` -> `[b, h_kv, n, d_h]`; for position-relative symbols the
        `[2K + 1, d]` table -> `[2K + 1, h_kv, d_h]`."""
        symbol_values = self.symbol_proj(symbols)
        if self.relative_symbols:
            return symbol_values.view(symbols.shape[0], -1, self.head_dim)
        n = symbols.shape[1]
        return symbol_values.view(symbols.shape[0], n, -1, self.head_dim).transpose(1, 2).expand(batch_size, -1, -1, -1)

    def forward(self, query, key, symbol_values, q_rel, k_rel, mask: AttentionMask, output_attentions=False,
                relative_position_index=None, **kwargs):
        """`relative_position_index` (optional, long `[q, kv]`): the row of the position-relative symbol table used by
        each (receiver, sender) pair, replacing the 1-D clipped offset `j - i` (e.g. 2-D offsets on an image grid)."""
        b, q_len = query.shape[0], query.shape[2]
        if self._takes_cpu_decode_kernel(query, mask, output_attentions):
            # A_i^h for the one receiver of each row, W_r included, in one call
            kv_len = key.shape[2]
            out = cpu_relational_decode(query, key, symbol_values.expand(b, -1, -1, -1), q_rel,
                                        k_rel.view(b, kv_len, self.num_relations, -1), self.relation_proj,
                                        self.scaling, self.relation_scaling, mask.mask)
            return self.o_proj(out.view(b, 1, -1)), None, None
        if self._takes_cpu_kernel(query, mask, output_attentions):
            kv_len = key.shape[2]
            attended_symbols, attended_relations = cpu_relational_attention(
                query, key, symbol_values.expand(b, -1, -1, -1), q_rel, k_rel.view(b, kv_len, self.num_relations, -1),
                mask.is_causal, self.scaling, self.relation_scaling, mask.mask)
            weights = relations = None
        elif self._takes_tiled_path(query, key, output_attentions):
            attended_symbols, attended_relations = tiled_relational_attention(
                query, key, symbol_values, q_rel, k_rel, mask, self.scaling, self.relation_scaling,
                self.num_key_value_groups)
            weights = relations = None
        elif self.uses_fused_path and not output_attentions and q_len == 1:
            # decoding: explicit weights, cheaper than assembling fused values from the whole cache
            attended_symbols, attended_relations = self._decode_step(query, key, symbol_values, q_rel, k_rel, mask)
            weights = relations = None
        elif self.uses_fused_path and not output_attentions:
            # values = [symbol values | relation keys]: sum_j a_ij k_rel_j rides along the symbols in one kernel
            kv_len = key.shape[2]
            k_rel_heads = k_rel[:, None].expand(b, self.num_kv_heads, kv_len, k_rel.shape[-1])
            value = torch.cat([symbol_values, k_rel_heads], dim=-1)
            if self.config._attn_implementation == "sdpa" and value.shape[-1] != query.shape[-1]:
                # fused SDPA kernels need equal query/value widths (else a math fallback materialises the n x n
                # weights): zero-padding queries and keys leaves every score unchanged
                pad = value.shape[-1] - query.shape[-1]
                query, key = nn.functional.pad(query, (0, pad)), nn.functional.pad(key, (0, pad))
            out, weights = run_attention(self, self.config, query, key, value, mask, **kwargs)
            attended_symbols, attended_keys = out.split([self.head_dim, k_rel.shape[-1]], dim=-1)
            attended_keys = attended_keys.reshape(b, q_len, self.num_heads, self.num_relations, self.relation_dim)
            # sum_j a_ij r_l(x_i, x_j) = <q_l(x_i), sum_j a_ij k_l(x_j)> / sqrt(d_r)
            attended_relations = (attended_keys * q_rel[:, :, None]).sum(-1) * self.relation_scaling  # [b, q, h, R]
            relations = None
        else:
            attended_symbols, attended_relations, weights, relations = self._blocked_attention(
                query, key, symbol_values, q_rel, k_rel, mask, output_attentions, relative_position_index
            )
        # A_i^h = sum_j a_ij s_j W_s^h + (sum_j a_ij r(x_i, x_j)) W_r^h
        out = attended_symbols + torch.einsum("bqhr,hdr->bqhd", attended_relations, self.relation_proj.to(query.dtype))
        if mask.row_valid is not None:
            out = out * mask.row_valid.transpose(1, 2).to(out.dtype)
            weights = None if weights is None else weights * mask.row_valid.to(weights.dtype)
        return self.o_proj(out.reshape(b, q_len, -1)), weights, relations

    def _decode_step(self, query, key, symbol_values, q_rel, k_rel, mask):
        """One receiver per row: query `[b, h, 1, d_h]` -> attended symbols `[b, 1, h, d_h]`, attended relations
        `[b, 1, h, R]`. Query heads sharing a kv head are rows of one product (no repeated keys)."""
        b, h, _, d = query.shape
        kv_len = key.shape[2]
        scores = torch.matmul(query.view(b, self.num_kv_heads, -1, d), key.transpose(2, 3)) * self.scaling
        kernel_mask = additive_mask(mask, 1, kv_len, query.dtype, query.device)  # [b|1, 1, 1, kv] or None
        if kernel_mask is not None:
            scores = scores + kernel_mask
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        weights = nn.functional.dropout(weights, p=self.attention_dropout, training=self.training)
        attended_symbols = torch.matmul(weights, symbol_values).view(b, 1, h, d)
        attended_keys = torch.bmm(weights.view(b, h, kv_len), k_rel).view(b, h, self.num_relations, -1)
        attended_relations = (attended_keys * q_rel.view(b, 1, self.num_relations, -1)).sum(-1)
        return attended_symbols, (attended_relations * self.relation_scaling).view(b, 1, h, self.num_relations)

    # ---- blocked path ------------------------------------------------------------------------------------------
    def _blocked_attention(self, query, key, symbol_values, q_rel, k_rel, mask, output_attentions,
                           relative_position_index=None):
        b, h, q_len, _ = query.shape
        kv_len = key.shape[2]
        key = repeat_kv(key, self.num_key_value_groups)
        if self.relative_symbols:
            symbol_values = symbol_values.repeat_interleave(self.num_key_value_groups, dim=1)  # [2K + 1, h, d_h]
        else:
            symbol_values = repeat_kv(symbol_values, self.num_key_value_groups)
        full_mask = additive_mask(mask, q_len, kv_len, query.dtype, query.device)
        k_rel = k_rel.view(b, kv_len, self.num_relations, self.relation_dim)
        block = q_len if output_attentions else max(1, min(q_len, BLOCK_SCORE_ELEMENTS // max(1, b * h * kv_len)))
        use_checkpoint = self.training and torch.is_grad_enabled() and block < q_len
        outputs = []
        for start in range(0, q_len, block):
            end = min(q_len, start + block)
            block_mask = None if full_mask is None else full_mask[:, :, start:end]
            block_index = None if relative_position_index is None else relative_position_index[start:end]
            args = (query[:, :, start:end], key, symbol_values, q_rel[:, start:end], k_rel, block_mask,
                    kv_len - q_len + start)
            if use_checkpoint:  # keep training memory linear in the sequence length
                outputs.append(torch.utils.checkpoint.checkpoint(
                    self._attend_block, *args, output_attentions, block_index, use_reentrant=False))
            else:
                outputs.append(self._attend_block(*args, output_attentions, block_index))
        symbols_out, relations_out, weights, relations = (
            torch.cat(parts, dim=1 if i < 2 else 2) if parts[0] is not None else None
            for i, parts in enumerate(zip(*outputs))
        )
        return symbols_out, relations_out, weights, relations

    def _attend_block(self, query, key, symbol_values, q_rel, k_rel, block_mask, q_offset, output_attentions,
                      relative_index=None):
        """One block of receivers: query `[b, h, q, d_h]` -> attended symbols `[b, q, h, d_h]`, attended relations
        `[b, q, h, R]` (+ weights `[b, h, q, kv]`, relations `[b, R, q, kv]` when asked). `relative_index` (long
        `[q, kv]`, optional) gives each pair's row of the position-relative table instead of the 1-D offset."""
        scores = torch.matmul(query, key.transpose(2, 3)) * self.scaling
        if block_mask is not None:
            scores = scores + block_mask
        weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
        weights = nn.functional.dropout(weights, p=self.attention_dropout, training=self.training)
        if self.relative_symbols:
            # bin each receiver's weights by clipped offset j - i, then mix the offset table: no [n, n, d] tensor
            q_len, kv_len, clip = query.shape[2], key.shape[2], self.max_relative_position
            offsets = torch.arange(kv_len, device=query.device)[None] - (
                torch.arange(q_len, device=query.device)[:, None] + q_offset)
            index = offsets.clamp(-clip, clip) + clip
            if relative_index is not None:  # precomputed bins (e.g. 2-D grid offsets), table of any size
                index = relative_index.to(query.device)
            index = index.expand_as(weights)
            binned = weights.new_zeros(*weights.shape[:3], symbol_values.shape[0]).scatter_add_(-1, index, weights)
            attended_symbols = torch.einsum("bhqk,khd->bqhd", binned, symbol_values)
        else:
            attended_symbols = torch.matmul(weights, symbol_values).transpose(1, 2)
        relations = None
        if self.relation_act is None and not output_attentions:
            # heads folded into rows: one [h * q, kv] @ [kv, R * d_r] product per batch, k_rel never copied per head
            b, h, q_len, kv_len = weights.shape
            attended_keys = torch.bmm(weights.reshape(b, h * q_len, kv_len), k_rel.flatten(2))
            attended_keys = attended_keys.view(b, h, q_len, self.num_relations, self.relation_dim)
            attended_relations = (attended_keys * q_rel[:, None]).sum(-1) * self.relation_scaling  # [b, h, q, R]
        else:
            # r_l(x_i, x_j) for this block: [b, R, q, kv]
            relations = torch.matmul(q_rel.transpose(1, 2), k_rel.permute(0, 2, 3, 1)) * self.relation_scaling
            if self.relation_act is not None:
                relations = self.relation_act(relations)
            attended_relations = torch.einsum("bhqk,brqk->bhqr", weights, relations)
        return (attended_symbols, attended_relations.transpose(1, 2),
                weights if output_attentions else None, relations if output_attentions else None)


# ---- tiled path (CPU) --------------------------------------------------------------------------------------------
# Relations computed once per (receiver, sender) pair and shared by every relational head: R * d_r + h * R
# multiply-adds per pair, instead of h * R * d_r when each head attends over the relation keys (the fused path).
# One tile = one batch row x a block of receivers x the senders they can see; backward recomputes the tile's
# scores, so memory stays linear in the sequence length.
TILE_SCORE_ELEMENTS = 1 << 20
# below this many (receiver, sender) pairs the fused path is cheaper (fewer, larger kernel calls)
TILED_MIN_PAIRS = 1 << 16

_UPPER_TRIANGLES = {}


def _upper_triangle(size: int, device) -> torch.Tensor:
    """bool `[size, size]`, True strictly above the diagonal (the future senders of a causal diagonal square)."""
    key = (size, str(device))
    if key not in _UPPER_TRIANGLES:
        _UPPER_TRIANGLES[key] = torch.ones(size, size, dtype=torch.bool, device=device).triu_(1)
    return _UPPER_TRIANGLES[key]


def _tiles(batch: int, heads: int, q_len: int, kv_len: int, causal: bool):
    """Yield (b, s, e, E): batch row b, receivers [s, e), senders [0, E) (causal tiles stop at their last receiver)."""
    rows = max(1, min(q_len, TILE_SCORE_ELEMENTS // max(1, heads * kv_len)))
    offset = kv_len - q_len
    for b in range(batch):
        for s in range(0, q_len, rows):
            e = min(q_len, s + rows)
            yield b, s, e, (offset + e if causal else kv_len)


def _tile_probabilities(query, key, mask, b, s, e, E, causal):
    """Attention weights of one tile: `[h, e - s, E]` (query tile pre-scaled; mask additive float or bool True =
    drop)."""
    scores = torch.matmul(query, key[b, :, :E].transpose(1, 2))
    if mask is not None:
        tile = mask[min(b, mask.shape[0] - 1), :, s:e, :E]
        if tile.dtype == torch.bool:
            scores.masked_fill_(tile, torch.finfo(scores.dtype).min)
        else:
            scores.add_(tile)
    elif causal and e - s > 1:  # senders after the receiver sit in the tile's last (e - s) columns
        scores[:, :, E - (e - s):].masked_fill_(_upper_triangle(e - s, scores.device), torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1)


class TiledRelationalAttentionFunction(torch.autograd.Function):
    """Relational attention with shared relations, tile by tile; inputs may be strided views (nothing is copied).

    query `[b, h, q, d_h]`, key, symbol values `[b, h, kv, d_h]` (symbol values may be expanded over the batch),
    relation queries `[b, q, R, d_r]`, relation keys `[b, kv, R, d_r]`, mask None or `[b|1, 1|h, q, kv]` (additive
    float, or bool True = drop) -> attended symbols `[b, q, h, d_h]`, attended relations `[b, q, h, R]`:

        P = softmax(scaling q k^T + mask)          rel_l = relation_scaling q_rel,l k_rel,l^T          (per tile)
        symbols = P v                              relations[i, h, l] = sum_j P[h, i, j] rel_l[i, j]
    """

    @staticmethod
    def forward(ctx, query, key, values, q_rel, k_rel, mask, causal, scaling, relation_scaling):
        b, h, q_len, d = query.shape
        symbols = query.new_empty(b, q_len, h, d)
        relations = query.new_empty(b, q_len, h, q_rel.shape[2])
        ctx.save_for_backward(query, key, values, q_rel, k_rel, mask)
        query, q_rel = query * scaling, q_rel * relation_scaling  # scaled once, not per tile
        for i, s, e, E in _tiles(b, h, q_len, key.shape[2], causal):
            probs = _tile_probabilities(query[i, :, s:e], key, mask, i, s, e, E, causal)  # [h, m, E]
            symbols[i, s:e] = torch.matmul(probs, values[i, :, :E]).transpose(0, 1)
            rel = torch.matmul(q_rel[i, s:e].transpose(0, 1), k_rel[i, :E].permute(1, 2, 0))  # [R, m, E]
            torch.bmm(probs.transpose(0, 1), rel.permute(1, 2, 0), out=relations[i, s:e])  # per receiver [h, R]
        ctx.causal, ctx.scaling, ctx.relation_scaling = causal, scaling, relation_scaling
        return symbols, relations

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_symbols, grad_relations):
        query, key, values, q_rel, k_rel, mask = ctx.saved_tensors
        scaling, relation_scaling = ctx.scaling, ctx.relation_scaling
        b, h, q_len, _ = query.shape
        grad_q, grad_k, grad_v = (query.new_zeros(t.shape) for t in (query, key, values))
        grad_q_rel, grad_k_rel = query.new_zeros(q_rel.shape), query.new_zeros(k_rel.shape)
        grad_symbols = grad_symbols.contiguous()  # [b, q, h, d_h]
        grad_relations = grad_relations.contiguous()  # [b, q, h, R]
        query, q_rel = query * scaling, q_rel * relation_scaling
        for i, s, e, E in _tiles(b, h, q_len, key.shape[2], ctx.causal):
            q_tile = query[i, :, s:e]  # [h, m, d_h]
            probs = _tile_probabilities(q_tile, key, mask, i, s, e, E, ctx.causal)  # [h, m, E]
            q_rel_tile = q_rel[i, s:e].transpose(0, 1)  # [R, m, d_r]
            rel = torch.matmul(q_rel_tile, k_rel[i, :E].permute(1, 2, 0))  # [R, m, E]
            g_symbols = grad_symbols[i, s:e].transpose(0, 1)  # [h, m, d_h]
            g_relations = grad_relations[i, s:e]  # [m, h, R]
            # dP = dSymbols v^T + dRelations rel (the second product is receiver-major: added as a transposed view,
            # since accumulating into a transposed view makes the kernel copy it twice)
            grad_probs = torch.matmul(g_symbols, values[i, :, :E].transpose(1, 2))  # [h, m, E]
            grad_probs.add_(torch.bmm(g_relations, rel.transpose(0, 1)).transpose(0, 1))
            # d rel_l[i, j] = sum_h dRelations[i, h, l] P[h, i, j]
            grad_rel = torch.bmm(g_relations.transpose(1, 2), probs.transpose(0, 1)).transpose(0, 1)  # [R, m, E]
            grad_v[i, :, :E] += torch.matmul(probs.transpose(1, 2), g_symbols)
            grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
            grad_q[i, :, s:e] = torch.matmul(grad_scores, key[i, :, :E])  # scaled after the loop
            grad_k[i, :, :E] += torch.matmul(grad_scores.transpose(1, 2), q_tile)
            grad_q_rel[i, s:e] = torch.matmul(grad_rel, k_rel[i, :E].transpose(0, 1)).transpose(0, 1)
            grad_k_rel[i, :E] += torch.matmul(grad_rel.transpose(1, 2), q_rel_tile).transpose(0, 1)
        grad_q.mul_(scaling)
        grad_q_rel.mul_(relation_scaling)
        return grad_q, grad_k, grad_v, grad_q_rel, grad_k_rel, None, None, None, None


def tiled_relational_attention(query, key, symbol_values, q_rel, k_rel, mask: AttentionMask, scaling: float,
                               relation_scaling: float, num_key_value_groups: int = 1):
    """Relational attention on the tiled path. query `[b, h, q, d_h]`, key, symbol values `[b|1, h_kv, kv, d_h]`,
    q_rel `[b, q, R, d_r]`, k_rel `[b, kv, R * d_r]` -> attended symbols `[b, q, h, d_h]`, attended relations
    `[b, q, h, R]` (with the relation scaling)."""
    b, kv_len, num_relations = key.shape[0], key.shape[2], q_rel.shape[2]
    key = repeat_kv(key, num_key_value_groups)
    symbol_values = repeat_kv(symbol_values.expand(b, -1, -1, -1), num_key_value_groups)
    k_rel = k_rel.view(b, kv_len, num_relations, -1)
    kernel_mask = mask.mask
    if kernel_mask is not None:
        kernel_mask = ~kernel_mask if kernel_mask.dtype == torch.bool else kernel_mask.to(query.dtype)
    causal = mask.mask is None and mask.is_causal
    return TiledRelationalAttentionFunction.apply(query, key, symbol_values, q_rel, k_rel, kernel_mask, causal,
                                                  scaling, relation_scaling)


class DualAttention(nn.Module):
    """Sensory heads and relational heads side by side; their outputs are concatenated (as in the reference).

    Every projection of the layer input (attention queries and keys of both head types, sensory values, relation
    queries and keys) is one matrix product (`fused_linear`), and RoPE rotates all queries and keys at once.
    One cache layer per DAT layer holds both head types: keys `[b, h_kv_s + h_kv_r, n, d_h]` and one flat value slot
    `[b, 1, n, h_kv_s * d_h + h_kv_r * d_h + R * d_r]` (sensory values | symbol values | relation keys), split
    after `Cache.update`.
    """

    def __init__(self, config, layer_idx: int, is_causal: bool = True):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.sensory = SensoryAttention(config, layer_idx, is_causal) if config.num_sensory_heads > 0 else None
        self.relational = RelationalAttention(config, layer_idx, is_causal) if config.num_relational_heads > 0 else None
        self.share_qk = config.share_attention_params and self.sensory is not None and self.relational is not None
        self.head_dim = config.head_dim
        # packing layout of the cache: key heads [relational | sensory], values [sensory | symbol values | relation
        # keys] (heads per value part; 0 = a flat `[b, N, width]` part)
        rel, sen = self.relational, self.sensory
        own_qk = [m for m in (rel, sen) if m is not None and not (m is sen and self.share_qk)]
        self._key_heads = [m.num_kv_heads for m in own_qk]
        self._query_heads = [m.num_heads for m in own_qk]
        self._key_heads_total = sum(self._key_heads)
        self._value_heads = ([sen.num_kv_heads] if sen is not None else []) + (
            ([rel.num_kv_heads] if not rel.relative_symbols else []) + [0] if rel is not None else [])
        self._value_widths = [heads * self.head_dim if heads else rel.num_relations * rel.relation_dim
                              for heads in self._value_heads]
        # the projections of the layer input, in the order of the fused output: keys [relational | sensory], queries
        # [relational | sensory], sensory values, relation queries, relation keys; as (owner, attribute) pairs, looked
        # up per call (adapters such as PEFT's replace the modules)
        names = {"relational": ("k_attn_proj", "q_attn_proj"), "sensory": ("k_proj", "q_proj")}
        owners = ["relational" if m is rel else "sensory" for m in own_qk]
        self._input_projections = [(o, names[o][0]) for o in owners] + [(o, names[o][1]) for o in owners]
        self._input_widths = [(sum(self._key_heads) + sum(self._query_heads)) * self.head_dim]
        if sen is not None:
            self._input_projections.append(("sensory", "v_proj"))
            self._input_widths.append(sen.num_kv_heads * self.head_dim)
        if rel is not None:
            relation_projections = ["q_rel_proj"] + ([] if rel.symmetric_relations else ["k_rel_proj"])
            self._input_projections += [("relational", name) for name in relation_projections]
            self._input_widths += [rel.num_relations * rel.relation_dim] * len(relation_projections)

    def forward(self, hidden_states, symbols, position_embeddings=None, sensory_mask=None, relational_mask=None,
                past_key_values=None, output_attentions=False, relative_position_index=None, **kwargs):
        """hidden_states `[b, n, d]` -> `[b, n, d]`. `relative_position_index` (long `[n, n]`, optional): rows of the
        position-relative symbol table per (receiver, sender) pair (see `RelationalAttention.forward`)."""
        b, n, _ = hidden_states.shape
        relational, sensory = self.relational, self.sensory  # (looked up once: module attributes are slow to get)
        linears = [getattr(relational if owner == "relational" else sensory, name)
                   for owner, name in self._input_projections]
        parts = list(fused_linear(linears, hidden_states).split(self._input_widths, dim=-1))
        # [keys | queries] of every head, `[b, n, heads, d_h]`: RoPE once for all, then `[b, heads, n, d_h]` views
        keys_queries = parts.pop(0).view(b, n, -1, self.head_dim)
        if position_embeddings is not None:
            keys_queries = rotate(keys_queries, *position_embeddings, heads_dim=2)
        keys_queries = keys_queries.transpose(1, 2)
        key_cache = keys_queries[:, : self._key_heads_total]  # what the cache stores
        values = []  # flat `[b, n, width]`: sensory values, symbol values, relation keys (those the layer has)
        if sensory is not None:
            values.append(parts.pop(0))
        if relational is not None:
            q_rel = parts[0].view(b, n, relational.num_relations, relational.relation_dim)
            # relation keys `[b, n, R * d_r]` (the relation queries themselves for symmetric relations)
            if relational.relative_symbols:
                sv = relational.project_symbols(symbols, b)  # the per-offset table, not cached
            else:
                values.append(relational.symbol_proj(symbols).expand(b, n, -1))
            values.append(parts[-1])
        if past_key_values is not None:
            value_cache = torch.cat(values, dim=-1) if len(values) > 1 else values[0]
            key_cache, value_cache = past_key_values.update(key_cache, value_cache[:, None], self.layer_idx)
            values = value_cache[:, 0].split(self._value_widths, dim=-1)
        values = self._value_views(values)  # [sensory values | symbol values] `[b, h_kv, N, d_h]`, relation keys
        if relational is not None:
            sv = sv if relational.relative_symbols else values[-2]
            k_rel = values[-1]
        keys = key_cache.split(self._key_heads, dim=1)
        queries = keys_queries[:, self._key_heads_total:].split(self._query_heads, dim=1)
        # with shared attention parameters the sensory heads use the relational heads' queries and keys
        q_r, k_r = queries[0], keys[0]
        q_s, k_s = (q_r, k_r) if self.share_qk else (queries[-1], keys[-1])

        outputs = []
        if sensory is not None:
            out_s, _ = sensory(q_s, k_s, values[0], sensory_mask, output_attentions=output_attentions, **kwargs)
            outputs.append(out_s)
        if relational is not None:
            out_r, _, _ = relational(q_r, k_r, sv, q_rel, k_rel, relational_mask, output_attentions=output_attentions,
                                     relative_position_index=relative_position_index, **kwargs)
            outputs.append(out_r)
        return torch.cat(outputs, dim=-1) if len(outputs) > 1 else outputs[0]

    def _value_views(self, parts):
        """Flat values `[b, N, width]` (cached as one `[b, 1, N, sum of widths]` slot) -> sensory values and symbol
        values `[b, h_kv, N, d_h]`, relation keys `[b, N, R * d_r]` (those the layer has, in that order)."""
        return [part.view(*part.shape[:2], heads, self.head_dim).transpose(1, 2) if heads else part
                for heads, part in zip(self._value_heads, parts)]


class InPlaceCacheLayer(DynamicLayer):
    """A `DynamicLayer` whose keys and values are prefix views of buffers with spare room: appending a decoding step
    copies the new token only, where `DynamicLayer` concatenates (copies) the whole cache every step.

    Buffers start at `capacity` (generate's maximum length) or at what the first update needs, and double when full.
    Anything else that replaces `keys`/`values` (crop, beam reordering, batch selection, device moves, other dtypes)
    is noticed at the next update, which then copies into fresh buffers, so a view handed out earlier is never
    overwritten.
    """

    def __init__(self, capacity: int | None = None):
        super().__init__()
        self.capacity = capacity
        self._length = 0
        self._buffers = None  # (keys `[..., capacity, d_k]`, values `[..., capacity, d_v]`)

    def update(self, key_states, value_states, *args, **kwargs):
        if torch.compiler.is_compiling():
            return super().update(key_states, value_states, *args, **kwargs)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length, new = self.get_seq_length(), key_states.shape[-2]
        if not self._owns(length, key_states, value_states):
            self._reallocate(length, length + new, key_states, value_states)
        key_buffer, value_buffer = self._buffers
        key_buffer[..., length:length + new, :].copy_(key_states)
        value_buffer[..., length:length + new, :].copy_(value_states)
        self.keys, self.values = key_buffer[..., :length + new, :], value_buffer[..., :length + new, :]
        self._length = length + new
        return self.keys, self.values

    def _owns(self, length, key_states, value_states) -> bool:
        """Whether `keys`/`values` are still this layer's prefix views, with room for the new states."""
        if self._buffers is None or length != self._length:
            return False
        for cached, buffer, new in zip((self.keys, self.values), self._buffers, (key_states, value_states)):
            if (cached.data_ptr() != buffer.data_ptr() or cached.stride() != buffer.stride()
                    or new.shape[:-2] != buffer.shape[:-2] or new.shape[-1] != buffer.shape[-1]
                    or new.dtype != buffer.dtype or new.device != buffer.device
                    or length + new.shape[-2] > buffer.shape[-2]):
                return False
        return True

    def _reallocate(self, length, needed, key_states, value_states):
        capacity = max(needed, self.capacity or 0)
        if self._buffers is not None and needed > (self.capacity or 0):
            capacity = max(capacity, 2 * needed)  # growing past the hint: double
        buffers = []
        for cached, new in ((self.keys, key_states), (self.values, value_states)):
            dtype = new.dtype if length == 0 else torch.promote_types(cached.dtype, new.dtype)
            buffer = new.new_empty(*new.shape[:-2], capacity, new.shape[-1], dtype=dtype)
            if length > 0:
                buffer[..., :length, :].copy_(cached)
            buffers.append(buffer)
        self._buffers = tuple(buffers)

    def reset(self) -> None:
        self._buffers, self._length = None, 0
        super().reset()


def use_in_place_cache_layers(cache, capacity: int | None = None):
    """Give a fresh `DynamicCache` (not offloaded) `InPlaceCacheLayer`s in place of its empty `DynamicLayer`s;
    `capacity` is the longest sequence expected (the buffers grow past it if needed). Returns `cache`."""
    if type(cache) is DynamicCache and not getattr(cache, "offloading", False):
        for i, layer in enumerate(cache.layers):
            if type(layer) is DynamicLayer and not layer.is_initialized:
                cache.layers[i] = InPlaceCacheLayer(capacity)
        if cache.layer_class_to_replicate is DynamicLayer:
            cache.layer_class_to_replicate = partial(InPlaceCacheLayer, capacity)
    return cache


__all__ = ["DualAttention", "SensoryAttention", "RelationalAttention", "DATRotaryEmbedding", "apply_rotary_pos_emb",
           "eager_attention_forward", "repeat_kv", "run_attention", "InPlaceCacheLayer", "use_in_place_cache_layers"]
