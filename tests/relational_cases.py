"""Shared inputs and helpers for the relational attention backend tests (`test_relational_backends.py`,
`test_cpu_kernel.py`): the case matrix, a stand-in for the `RelationalAttention` module the backends read, and the
package's reference (`eager_relational_attention`) split into its two aggregations."""

import contextlib

import torch
from torch import nn
from transformers.activations import ACT2FN

from dat_hf.attention_plan import mask_in_format
from dat_hf.masking_dat import AttentionMask
from dat_hf.relational_attention import RELATIONAL_ATTENTION_FUNCTIONS, RelationalSpec, RelativeSymbols

SCALING, RELATION_SCALING = 0.37, 0.61


class Heads(nn.Module):
    """What a backend reads from its `module`: W_r `[h, d_h, R]`, the relation activation, GQA groups,
    position-relative symbols."""

    def __init__(self, h=4, h_kv=4, d=6, R=3, activation="identity", relative=False, max_relative_position=3,
                 relation_proj=None, dtype=torch.float64, seed=0):
        super().__init__()
        if relation_proj is None:
            relation_proj = torch.randn(h, d, R, generator=torch.Generator().manual_seed(50 + seed), dtype=dtype)
        self.relation_proj = nn.Parameter(relation_proj)
        self.relation_activation = activation
        self.relation_act = None if activation == "identity" else ACT2FN[activation]
        self.num_key_value_groups = h // h_kv
        self.relative_symbols = relative
        self.max_relative_position = max_relative_position
        self.attention_dropout = 0.0
        self.is_causal = True
        self.layer_idx = 0

    def local_relation_proj(self):
        """W_r as the plan reads it (`RelationalAttention.local_relation_proj`: this rank's heads)."""
        return self.relation_proj


def make_inputs(b=2, h=4, h_kv=4, q_len=10, kv_len=10, d=6, R=3, d_r=5, symbol_batch=None, seed=0,
                dtype=torch.float64, relative_rows=None):
    """query `[b, h, q, d]`, key `[b, h_kv, kv, d]`, symbol values `[b|1, h_kv, kv, d]` (or a position-relative table
    `[relative_rows, h_kv, d]`), relation queries `[b, q, R, d_r]`, relation keys `[b, kv, R, d_r]`; leaves that
    require gradients."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    symbols = randn(relative_rows, h_kv, d) if relative_rows else randn(symbol_batch or b, h_kv, kv_len, d)
    return (randn(b, h, q_len, d), randn(b, h_kv, kv_len, d), symbols, randn(b, q_len, R, d_r),
            randn(b, kv_len, R, d_r))


def random_bool_mask(b, q_len, kv_len, seed=0, p=0.4):
    """bool `[b, 1, q, kv]`, True = attend; every receiver keeps at least one sender (rows without senders are
    unmasked upstream)."""
    g = torch.Generator().manual_seed(100 + seed)
    mask = torch.rand(b, 1, q_len, kv_len, generator=g) > p
    mask[..., torch.arange(q_len), torch.randint(0, kv_len, (q_len,), generator=g)] = True
    assert not mask.all()
    return mask


def right_padding(b, kv_len, lengths):
    """bool `[b, 1, 1, kv]`: row i's senders beyond lengths[i] are padding."""
    return (torch.arange(kv_len)[None] < torch.tensor(lengths)[:, None])[:, None, None]


def additive_from_bool(mask, dtype=torch.float64, seed=0):
    """An additive float mask: finfo.min where dropped, a finite bias where kept."""
    g = torch.Generator().manual_seed(200 + seed)
    return torch.randn(mask.shape, generator=g, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)


def causal_and(mask, q_len, kv_len):
    """A bool mask intersected with the causal order (receiver i at position kv - q + i)."""
    return mask & (torch.arange(kv_len)[None, :] <= torch.arange(q_len)[:, None] + (kv_len - q_len))


def reference_parts(query, key, values, q_rel, k_rel, mask: AttentionMask, scaling=SCALING,
                    relation_scaling=RELATION_SCALING, activation="identity"):
    """(attended symbols `[b, q, h, d]`, attended relations `[b, q, h, R]`) from the package's reference: with W_r = 0
    its messages are the attended symbols; with zero symbol values and W_r the identity on the first R of the d_h
    channels, they are the attended relations (needs d_h >= R)."""
    h, d, R = query.shape[1], query.shape[3], q_rel.shape[2]
    groups = h // key.shape[1]
    zeros = torch.zeros(h, d, R, dtype=query.dtype)
    picks = torch.zeros(h, d, R, dtype=query.dtype)
    picks[:, torch.arange(R), torch.arange(R)] = 1.0
    symbols_only = Heads(h, h // groups, d, R, activation, relation_proj=zeros)
    relations_only = Heads(h, h // groups, d, R, activation, relation_proj=picks)
    symbols, _, _ = call_backend("eager", symbols_only, query, key, values, q_rel, k_rel, mask, scaling,
                                 relation_scaling)
    relations, _, _ = call_backend("eager", relations_only, query, key, torch.zeros_like(values), q_rel, k_rel,
                                   mask, scaling, relation_scaling)
    return symbols, relations[..., :R]


def call_backend(backend, module, query, key, symbol_values, relation_queries, relation_keys, mask: AttentionMask,
                 scaling=SCALING, relation_scaling=RELATION_SCALING, dropout=0.0, output_attentions=False,
                 relative_position_index=None, query_offset=None):
    """Run a relational backend (a registered name, or a function taking the "tensor" format) as the attention plan
    would: the heads' `RelationalSpec` and W_r from the stand-in `module`, the mask in the backend's format, the
    position-relative symbol rows when `module.relative_symbols`."""
    if isinstance(backend, str):
        function, mask_format = RELATIONAL_ATTENTION_FUNCTIONS[backend].function, RELATIONAL_ATTENTION_FUNCTIONS[
            backend].mask_format
    else:
        function, mask_format = backend, "window"
    spec = RelationalSpec(module.num_key_value_groups, scaling, relation_scaling, module.relation_act)
    symbols_at = None
    if module.relative_symbols:
        symbols_at = RelativeSymbols(module.max_relative_position, query_offset, None, relative_position_index)
    return function(query, key, symbol_values, relation_queries, relation_keys, module.relation_proj,
                    mask_in_format(mask, mask_format), spec, dropout, output_attentions=output_attentions,
                    symbols_at=symbols_at)


def assert_close(got, expected, atol=1e-5, rtol=0.0, what=""):
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    diff = (got.double() - expected.double()).abs().max().item()
    scale = expected.abs().max().item()
    assert diff <= atol + rtol * scale, f"{what}: max |diff| {diff:.3g} (scale {scale:.3g})"


@contextlib.contextmanager
def count_backend_calls(name):
    """Counts the calls of the registered backend `name` inside the block: yields a one-element list."""
    backend = RELATIONAL_ATTENTION_FUNCTIONS[name]
    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return backend.function(*args, **kwargs)

    RELATIONAL_ATTENTION_FUNCTIONS[name] = backend._replace(function=counted)
    try:
        yield calls
    finally:
        RELATIONAL_ATTENTION_FUNCTIONS[name] = backend
