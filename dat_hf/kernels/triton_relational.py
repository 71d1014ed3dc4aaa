"""Relational attention in Triton, forward and backward (backend `"triton"`, preferred on CUDA).

For batch row b, receiver i, query head h (kv head g = h // (h / h_kv)) and relation l:

    p_hij = softmax_j(scaling <q_hi, k_gj> + mask)                 r_l(i, j) = relation_scaling <q_rel_il, k_rel_jl>
    symbols_hi = sum_j p_hij v_gj   [b, q, h, d_h]                 relations_hil = sum_j p_hij r_l(i, j)   [b, q, h, R]

(the backend adds `relations W_r^T` in PyTorch). The relations are formed per (receiver, sender) tile, shared by the
heads of the program, and never stored.

Grid of every kernel: (blocks of the program's own receivers or senders, batch rows x head chunks[, sender
splits]). A program owns HEADS query heads of one batch row (h rounded up to a power of two, at most
`HEADS_PER_PROGRAM` = 8; more heads take several chunks, each forming the relations again) and holds per-head tiles
`[HEADS, BLOCK_M, ...]`; scores are batched products `[HEADS, BLOCK_M, d_h] x [HEADS, d_h, BLOCK_N]` whose key and
value tiles are read per kv head (GQA: nothing is repeated in memory).
- masks: causal order (receiver i at position p = offset + i, offset = kv - q (`receiver_offset`), sees senders
  j <= p), a sliding window of the `window` previous tokens (dat_hf's convention, `sliding_window_size`:
  `p - window <= j <= p`, or two-sided `|p - j| <= window`) and a bool mask `[b|1, 1, q|1, kv]` (padding, other
  graphs), all three combinable. Causal order and window come from index arithmetic: they bound the
  loops (the senders of a receiver tile from p_first - window to p_last (+ window), the receivers of a sender tile
  likewise) and mask the boundary tiles, so a window costs O(n * window) in one launch with no mask tensor.
- forward, program = (BLOCK_M receivers, b, chunk): walks the senders in BLOCK_N blocks within the causal and window
  bounds (a block that the bool mask leaves empty is skipped once its mask tile is read) with an online softmax per
  head: the scores, then for each relation l the tile r_l = q_rel_l k_rel_l^T, ONCE for all the program's heads, and
  its sums sum_j p_hij r_l(i, j) for every head, then P V. Writes symbols, relations and the log-sum-exp `[b, h, q]`
  (base 2). Where the blocks of receivers are too few to fill the GPU (a decoding step: one per batch row and head
  chunk), the senders are split among programs as well (flash-decoding, grid axis 2: `_sender_splits`), each writing
  its float32 outputs and log-sum-exp, which `_combine_splits` joins.
- backward: two kernels that recompute the tiles from the log-sum-exp (no atomics: deterministic), with
      dP = dSymbols V^T + sum_l dRelations_l r_l     D = <dSymbols, symbols> + <dRelations, relations>
      dS = P (dP - D)                                dr_l = sum_h P_h dRelations_h,l
  `dkv`, program = (BLOCK_N senders, b, chunk), walks receivers: dV += P^T dSymbols, dK += dS^T Q, dK_rel_l += dr_l^T
  Q_rel_l; `dq`, program = (BLOCK_M receivers, b, chunk), walks senders: dQ += dS K, dQ_rel_l += dr_l K_rel_l.

Multiply-adds per (receiver, sender) pair and head chunk of h heads:
  forward   2 h d_h (scores, P V) + R d_r (relations, shared by the heads) on tensor cores; h R (weighted relations)
            on CUDA cores;
  backward  7 h d_h + 4 R d_r on tensor cores; 4 h R plus R^2 d_r / block (the per-relation gradient accumulators)
            on CUDA cores.
At the authors' 343M shapes (h 8, d_h 64, R 8, d_r 64) the forward costs 1024 + 512 + 64 per pair, where fused values
with queries padded to the value width (`sdpa`) cost 2 h (d_h + R d_r) = 9216. The h R work runs on CUDA cores: with
many relations (the 1.27B config: h 16, R 128, d_r 8) it dominates, and the per-relation loops hold `[HEADS, BLOCK_M,
R]` accumulators. Batched (3-D) `tl.dot` is, to our knowledge, lowered to mma.sync rather than Hopper's wgmma (not
measured). Block sizes are autotuned on the GPU (BLOCK_M 16-64, BLOCK_N 16-64, 4-8 warps, 1-3 stages), or fixed to the
smallest config with `DAT_HF_TRITON_AUTOTUNE=0` (checks of many shapes: one compilation per shape, not one per config);
the interpreter runs 16 x 32 blocks. Head and relation dims are padded to powers of two of at least 16 (the smallest
`tl.dot`), the relation count to a power of two.

Dtypes: float32 (dots in IEEE precision, not TF32), float16, bfloat16, with float32 accumulation and softmax.
Tests run the kernels on CPU tensors with `TRITON_INTERPRET=1` set before `dat_hf` is imported; there bfloat16
operands of `tl.dot` are widened to float32 first (the interpreter multiplies their raw bits): exact products and a
float32 sum, as on the GPU.
"""

import contextlib
import functools
import os

import torch
import triton
import triton.language as tl

from ..masking_dat import receiver_offset
from ..relational_attention import (RELATIONAL_ATTENTION_FUNCTIONS, RelationalBackendUnavailable, RelationalCall,
                                    relational_output)
from ..relational_attention_fused import fused_values_limits
from .autograd import relational_op_autograd


# as the kernels below are decorated: they stay interpreted (or compiled) for the life of the process
INTERPRETED = (bool(triton.knobs.runtime.interpret) if hasattr(triton, "knobs")
               else os.environ.get("TRITON_INTERPRET", "0") == "1")
HEADS_PER_PROGRAM = 8
LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TUNING_KEY = ["HEADS", "GROUPS", "HEAD_DIM", "NUM_RELATIONS", "RELATION_DIM", "CAUSAL", "WINDOWED", "HAS_MASK"]


def _configs(shapes, every: bool = False):
    """Autotuning configs (BLOCK_M, BLOCK_N, warps, stages) on the GPU (the first only with `DAT_HF_TRITON_AUTOTUNE=0`,
    unless `every`); one small config under the interpreter (which ignores warps and stages)."""
    if INTERPRETED:
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32})]
    if os.environ.get("DAT_HF_TRITON_AUTOTUNE", "1") == "0" and not every:
        shapes = shapes[:1]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


# Shared memory holds num_stages copies of the streamed tiles, HEADS-fold (e.g. 8 heads x 32 senders x d_h 64 of key
# and value in bfloat16: 64 KB a stage); configs that do not fit fail to compile and the autotuner skips them, the
# single-stage 16 x 16 config fits every head dim up to 128.
# forward and dq: BLOCK_M receivers x HEADS heads of accumulators, senders streamed in BLOCK_N blocks
RECEIVER_SHAPES = [(16, 16, 4, 1), (16, 16, 4, 2), (16, 32, 4, 2), (16, 32, 8, 3), (32, 16, 8, 2), (32, 32, 8, 2),
                   (16, 64, 8, 2)]
_RECEIVER_CONFIGS = _configs(RECEIVER_SHAPES)
# dkv: BLOCK_N senders x HEADS heads of accumulators, receivers streamed in BLOCK_M blocks
SENDER_SHAPES = [(16, 16, 4, 1), (16, 16, 4, 2), (32, 16, 4, 2), (32, 16, 8, 3), (64, 16, 8, 2), (32, 32, 8, 2)]
_SENDER_CONFIGS = _configs(SENDER_SHAPES)


# ---- tile helpers ----------------------------------------------------------------------------------------------
@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """a @ b (batched when 3-D) with a float32 result; WIDEN: float32 operands (bfloat16 under the interpreter)."""
    if WIDEN:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _head_tile(ptr, heads, stride_h, rows, stride_row, n_rows, cols, stride_col, n_cols, head_ok):
    """`[HEADS, ROWS, COLS]` tile of a per-head tensor (zeros outside)."""
    offsets = heads[:, None, None] * stride_h + rows[None, :, None] * stride_row + cols[None, None, :] * stride_col
    inside = head_ok[:, None, None] & (rows < n_rows)[None, :, None] & (cols < n_cols)[None, None, :]
    return tl.load(ptr + offsets, mask=inside, other=0.0)


@triton.jit
def _tile(ptr, rows, stride_row, n_rows, cols, stride_col, n_cols):
    """`[ROWS, COLS]` tile (zeros outside)."""
    inside = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    return tl.load(ptr + rows[:, None] * stride_row + cols[None, :] * stride_col, mask=inside, other=0.0)


@triton.jit
def _head_rows(ptr, heads, stride_h, rows, stride_row, n_rows, head_ok, other):
    """`[HEADS, ROWS]` values of a per-(head, receiver) quantity (log-sum-exp, D, one relation's gradient)."""
    inside = head_ok[:, None] & (rows < n_rows)[None, :]
    return tl.load(ptr + heads[:, None] * stride_h + rows[None, :] * stride_row, mask=inside, other=other)


@triton.jit
def _visible(MASK, mask_row, stride_mm, stride_mn, offs_m, offs_n, q_len, kv_len, offset, window_lo, window_hi,
             CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HAS_MASK: tl.constexpr):
    """`[BLOCK_M, BLOCK_N]` bool: receiver offs_m, at position p = offset + i, may attend to sender offs_n: j <= p
    (causal), p - window_lo <= j <= p + window_hi (window)."""
    visible = (offs_m < q_len)[:, None] & (offs_n < kv_len)[None, :]
    position = offs_m[:, None] + offset
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= position)
    if WINDOWED:
        visible = visible & (offs_n[None, :] >= position - window_lo) & (offs_n[None, :] <= position + window_hi)
    if HAS_MASK:
        allowed = tl.load(MASK + mask_row + offs_m[:, None] * stride_mm + offs_n[None, :] * stride_mn, mask=visible,
                          other=0)
        visible = visible & (allowed != 0)
    return visible


@triton.jit
def _sender_range(q0, q_len, kv_len, offset, window_lo, window_hi, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[start, end) of the senders that receivers [q0, q0 + BLOCK_M) may see (start on a BLOCK_N boundary):
    p_first - window_lo <= j <= p_last + window_hi (window), j <= p_last (causal), p = offset + i."""
    first = q0 + offset  # position of the first receiver
    last = tl.minimum(q0 + BLOCK_M, q_len) - 1 + offset
    start = 0
    end = kv_len
    if WINDOWED:
        start = (tl.maximum(first - window_lo, 0) // BLOCK_N) * BLOCK_N
        end = tl.minimum(end, last + window_hi + 1)
    if CAUSAL:
        end = tl.minimum(end, last + 1)
    return start, end


@triton.jit
def _receiver_range(n0, q_len, offset, window_lo, window_hi, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[start, end) of the receivers that may see senders [n0, n0 + BLOCK_N) (start on a BLOCK_M boundary): receiver
    i sees sender j when j - window_hi <= p <= j + window_lo (window) and j <= p (causal), p = offset + i."""
    start = 0
    end = q_len
    if WINDOWED:
        end = tl.minimum(q_len, n0 + BLOCK_N + window_lo - offset)
        if not CAUSAL:
            start = (tl.maximum(n0 - window_hi - offset, 0) // BLOCK_M) * BLOCK_M
    if CAUSAL:
        start = (tl.maximum(n0 - offset, 0) // BLOCK_M) * BLOCK_M
    return start, end


@triton.jit
def _scores(q, k, visible, qk_scale, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """Base-2 scores `[HEADS, BLOCK_M, BLOCK_N]` = qk_scale q k^T where visible, else -inf."""
    scores = _dot(q, tl.permute(k, (0, 2, 1)), PRECISION, WIDEN) * qk_scale
    return tl.where(visible[None, :, :], scores, float("-inf"))


@triton.jit
def _relation(QR, KR, offs_m, stride_qm, q_len, offs_n, stride_kn, kv_len, offs_c, RELATION_DIM: tl.constexpr,
              relation_scaling, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """(r_l `[BLOCK_M, BLOCK_N]` float32, q_rel_l `[BLOCK_M, DR]`, k_rel_l `[BLOCK_N, DR]`); QR and KR point at relation
    l of this batch row."""
    q_rel = _tile(QR, offs_m, stride_qm, q_len, offs_c, 1, RELATION_DIM)
    k_rel = _tile(KR, offs_n, stride_kn, kv_len, offs_c, 1, RELATION_DIM)
    return _dot(q_rel, tl.trans(k_rel), PRECISION, WIDEN) * relation_scaling, q_rel, k_rel


@triton.jit
def _program_heads(num_heads, HEADS: tl.constexpr):
    """(batch row b, (head chunk, b) as one index of `[chunks, batch]`, the chunk's query heads `[HEADS]`, which of
    them exist) of this program (grid axis 1: batch rows x head chunks)."""
    chunks = tl.cdiv(num_heads, HEADS)
    chunk = tl.program_id(1) % chunks
    b = (tl.program_id(1) // chunks).to(tl.int64)
    heads = chunk * HEADS + tl.arange(0, HEADS)
    return b, chunk * (tl.num_programs(1) // chunks) + b, heads, heads < num_heads


@triton.jit
def _sender_tiles(K, V, b, kv_heads, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, offs_n, kv_len, offs_d,
                  HEAD_DIM: tl.constexpr, head_ok):
    """Key and symbol value tiles `[HEADS, BLOCK_N, D]` of batch row b, read at each query head's kv head."""
    k = _head_tile(K + b * sk_b, kv_heads, sk_h, offs_n, sk_n, kv_len, offs_d, 1, HEAD_DIM, head_ok)
    v = _head_tile(V + b * sv_b, kv_heads, sv_h, offs_n, sv_n, kv_len, offs_d, 1, HEAD_DIM, head_ok)
    return k, v


@triton.jit
def _receiver_tiles(Q, D_SYMBOLS, LSE, DELTA, b, heads, sq_b, sq_h, sq_m, offs_m, q_len, offs_d, num_heads,
                    HEAD_DIM: tl.constexpr, head_ok):
    """What the backward reads per block of receivers of batch row b: the query and dSymbols `[HEADS, BLOCK_M, D]`
    (dSymbols `[b, q, h, d_h]`), the log-sum-exp and D `[HEADS, BLOCK_M]` (`[b, h, q]`)."""
    q = _head_tile(Q + b * sq_b, heads, sq_h, offs_m, sq_m, q_len, offs_d, 1, HEAD_DIM, head_ok)
    d_symbols = _head_tile(D_SYMBOLS + b * q_len * num_heads * HEAD_DIM, heads, HEAD_DIM, offs_m,
                           num_heads * HEAD_DIM, q_len, offs_d, 1, HEAD_DIM, head_ok)
    lse = _head_rows(LSE + b * num_heads * q_len, heads, q_len, offs_m, 1, q_len, head_ok, float("inf"))
    delta = _head_rows(DELTA + b * num_heads * q_len, heads, q_len, offs_m, 1, q_len, head_ok, 0.0)
    return q, d_symbols, lse, delta


# ---- forward -----------------------------------------------------------------------------------------------------
@triton.autotune(configs=_RECEIVER_CONFIGS, key=_TUNING_KEY)
@triton.jit
def _forward_kernel(Q, K, V, QR, KR, MASK, SYMBOLS, RELATIONS, LSE,
                    sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sqr_b, sqr_m, sqr_l, skr_b, skr_n, skr_l,
                    sm_b, sm_m, sm_n, num_heads, q_len, kv_len, offset, window_lo, window_hi, qk_scale,
                    relation_scaling, split_size,
                    HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_RELATIONS: tl.constexpr,
                    RELATION_DIM: tl.constexpr, D_PAD: tl.constexpr, R_PAD: tl.constexpr, DR_PAD: tl.constexpr,
                    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HAS_MASK: tl.constexpr, PRECISION: tl.constexpr,
                    WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Symbols `[b, q, h, d_h]`, relations `[b, q, h, R]` and the log-sum-exp `[b, h, q]` of one block of receivers,
    walking the senders it sees among split `program_id(2)`'s (senders [split * split_size, + split_size): a
    multiple of every BLOCK_N), into that split's slice of the outputs `[splits, ...]`."""
    # (slot is unused here; named, since `_` is rebound to tensors in the loop and Triton fixes loop-carried types)
    b, slot, heads, head_ok = _program_heads(num_heads, HEADS)
    split = tl.program_id(2).to(tl.int64)
    batch = tl.num_programs(1) // tl.cdiv(num_heads, HEADS)
    SYMBOLS += split * batch * q_len * num_heads * HEAD_DIM
    RELATIONS += split * batch * q_len * num_heads * NUM_RELATIONS
    LSE += split * batch * num_heads * q_len
    q0 = tl.program_id(0) * BLOCK_M
    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_c = tl.arange(0, DR_PAD)
    relation_ids = tl.arange(0, R_PAD)
    q = _head_tile(Q + b * sq_b, heads, sq_h, offs_m, sq_m, q_len, offs_d, 1, HEAD_DIM, head_ok)
    m_i = tl.full([HEADS, BLOCK_M], float("-inf"), tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([HEADS, BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc_symbols = tl.zeros([HEADS, BLOCK_M, D_PAD], tl.float32)
    acc_relations = tl.zeros([HEADS, BLOCK_M, R_PAD], tl.float32)
    start, end = _sender_range(q0, q_len, kv_len, offset, window_lo, window_hi, CAUSAL, WINDOWED, BLOCK_M, BLOCK_N)
    start = tl.maximum(start, split * split_size)
    end = tl.minimum(end, (split + 1) * split_size)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = _visible(MASK, b * sm_b, sm_m, sm_n, offs_m, offs_n, q_len, kv_len, offset,
                           window_lo, window_hi, CAUSAL, WINDOWED, HAS_MASK)
        if tl.max(visible.to(tl.int32)) > 0:
            k, v = _sender_tiles(K, V, b, heads // GROUPS, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, offs_n, kv_len, offs_d,
                                 HEAD_DIM, head_ok)
            scores = _scores(q, k, visible, qk_scale, PRECISION, WIDEN)
            m_new = tl.maximum(m_i, tl.max(scores, axis=2))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no sender seen yet: keep everything at 0
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(scores - m_safe[:, :, None])
            l_i = l_i * alpha + tl.sum(p, axis=2)
            acc_symbols = acc_symbols * alpha[:, :, None] + _dot(p.to(v.dtype), v, PRECISION, WIDEN)
            acc_relations = acc_relations * alpha[:, :, None]
            for l in range(NUM_RELATIONS):
                rel, _, _ = _relation(QR + b * sqr_b + l * sqr_l, KR + b * skr_b + l * skr_l, offs_m, sqr_m, q_len,
                                      offs_n, skr_n, kv_len, offs_c, RELATION_DIM, relation_scaling, PRECISION, WIDEN)
                weighted = tl.sum(p * rel[None, :, :], axis=2)  # sum_j p_hij r_l(i, j): [HEADS, BLOCK_M]
                acc_relations += tl.where(relation_ids[None, None, :] == l, weighted[:, :, None], 0.0)
            m_i = m_new
    has_senders = l_i > 0
    inv = tl.where(has_senders, 1.0 / tl.where(has_senders, l_i, 1.0), 0.0)  # a receiver without senders gets 0
    row = (b * q_len + offs_m) * num_heads  # [b, q, h, ...] outputs
    inside = head_ok[:, None, None] & (offs_m < q_len)[None, :, None]
    tl.store(SYMBOLS + (row[None, :, None] + heads[:, None, None]) * HEAD_DIM + offs_d[None, None, :],
             (acc_symbols * inv[:, :, None]).to(SYMBOLS.dtype.element_ty),
             mask=inside & (offs_d < HEAD_DIM)[None, None, :])
    tl.store(RELATIONS + (row[None, :, None] + heads[:, None, None]) * NUM_RELATIONS + relation_ids[None, None, :],
             (acc_relations * inv[:, :, None]).to(RELATIONS.dtype.element_ty),
             mask=inside & (relation_ids < NUM_RELATIONS)[None, None, :])
    lse = tl.where(has_senders, m_i + tl.log2(tl.where(has_senders, l_i, 1.0)), float("inf"))
    tl.store(LSE + (b * num_heads + heads[:, None]) * q_len + offs_m[None, :], lse,
             mask=head_ok[:, None] & (offs_m < q_len)[None, :])


# ---- backward ----------------------------------------------------------------------------------------------------
@triton.jit
def _tile_gradients(q, k, v, d_symbols, lse, delta, visible, acc_rel, QR, KR, D_RELATIONS, b, offs_m, sqr_b, sqr_m,
                    sqr_l, q_len, offs_n, skr_b, skr_n, skr_l, kv_len, offs_c, heads, num_heads, head_ok, qk_scale,
                    relation_scaling, NUM_RELATIONS: tl.constexpr, RELATION_DIM: tl.constexpr, R_PAD: tl.constexpr,
                    SENDER_SIDE: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr):
    """One (receivers, senders) tile of the backward -> (P, dS) `[HEADS, BLOCK_M, BLOCK_N]` and `acc_rel` plus this
    tile's relation-key gradients `[R_PAD, BLOCK_N, DR]` (SENDER_SIDE) or relation-query gradients
    `[R_PAD, BLOCK_M, DR]`."""
    p = tl.exp2(_scores(q, k, visible, qk_scale, PRECISION, WIDEN) - lse[:, :, None])
    dp = _dot(d_symbols, tl.permute(v, (0, 2, 1)), PRECISION, WIDEN)  # dSymbols V^T
    relation_ids = tl.arange(0, R_PAD)
    D_RELATIONS += b * q_len * num_heads * NUM_RELATIONS  # [b, q, h, R]
    for l in range(NUM_RELATIONS):
        rel, q_rel, k_rel = _relation(QR + b * sqr_b + l * sqr_l, KR + b * skr_b + l * skr_l, offs_m, sqr_m, q_len,
                                      offs_n, skr_n, kv_len, offs_c, RELATION_DIM, relation_scaling, PRECISION, WIDEN)
        d_relations = _head_rows(D_RELATIONS + l, heads, NUM_RELATIONS, offs_m, num_heads * NUM_RELATIONS, q_len,
                                 head_ok, 0.0).to(tl.float32)
        dp += d_relations[:, :, None] * rel[None, :, :]  # + sum_l dRelations_l r_l
        d_rel = tl.sum(p * d_relations[:, :, None], axis=0) * relation_scaling  # dr_l = sum_h P_h dRelations_h,l
        if SENDER_SIDE:
            part = _dot(tl.trans(d_rel).to(q_rel.dtype), q_rel, PRECISION, WIDEN)  # [BLOCK_N, DR]
        else:
            part = _dot(d_rel.to(k_rel.dtype), k_rel, PRECISION, WIDEN)  # [BLOCK_M, DR]
        acc_rel += tl.where(relation_ids[:, None, None] == l, part[None, :, :], 0.0)
    return p, p * (dp - delta[:, :, None]), acc_rel


@triton.jit
def _store_relation_gradients(PTR, acc, slot, offs, n_rows, offs_c, NUM_RELATIONS: tl.constexpr,
                              RELATION_DIM: tl.constexpr, R_PAD: tl.constexpr):
    """acc `[R_PAD, ROWS, DR]` -> rows `offs` of the float32 `[chunks, batch, n_rows, R, d_r]` at `slot` (chunk, b)."""
    relation_ids = tl.arange(0, R_PAD)
    rows = (slot * n_rows + offs[None, :, None]) * NUM_RELATIONS + relation_ids[:, None, None]
    inside = (relation_ids < NUM_RELATIONS)[:, None, None] & (offs < n_rows)[None, :, None]
    tl.store(PTR + rows * RELATION_DIM + offs_c[None, None, :], acc,
             mask=inside & (offs_c < RELATION_DIM)[None, None, :])


@triton.autotune(configs=_SENDER_CONFIGS, key=_TUNING_KEY)
@triton.jit
def _backward_dkv_kernel(Q, K, V, QR, KR, MASK, D_SYMBOLS, D_RELATIONS, LSE, DELTA, DK, DV, DKR,
                         sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sqr_b, sqr_m, sqr_l, skr_b, skr_n,
                         skr_l, sm_b, sm_m, sm_n, num_heads, q_len, kv_len, offset, window_lo, window_hi, qk_scale,
                         scaling, relation_scaling, HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         NUM_RELATIONS: tl.constexpr, RELATION_DIM: tl.constexpr, D_PAD: tl.constexpr,
                         R_PAD: tl.constexpr, DR_PAD: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                         HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr):
    """dK, dV `[b, h, kv, d_h]` (per query head, float32) and dK_rel `[chunks, b, kv, R, d_r]` (float32) of one block
    of senders, walking the receivers that can see it."""
    b, slot, heads, head_ok = _program_heads(num_heads, HEADS)
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    offs_c = tl.arange(0, DR_PAD)
    k, v = _sender_tiles(K, V, b, heads // GROUPS, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, offs_n, kv_len, offs_d,
                         HEAD_DIM, head_ok)
    dk = tl.zeros([HEADS, BLOCK_N, D_PAD], tl.float32)
    dv = tl.zeros([HEADS, BLOCK_N, D_PAD], tl.float32)
    dkr = tl.zeros([R_PAD, BLOCK_N, DR_PAD], tl.float32)
    start, end = _receiver_range(n0, q_len, offset, window_lo, window_hi, CAUSAL, WINDOWED, BLOCK_M, BLOCK_N)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        visible = _visible(MASK, b * sm_b, sm_m, sm_n, offs_m, offs_n, q_len, kv_len, offset,
                           window_lo, window_hi, CAUSAL, WINDOWED, HAS_MASK)
        if tl.max(visible.to(tl.int32)) > 0:
            q, d_symbols, lse, delta = _receiver_tiles(Q, D_SYMBOLS, LSE, DELTA, b, heads, sq_b, sq_h, sq_m, offs_m,
                                                       q_len, offs_d, num_heads, HEAD_DIM, head_ok)
            p, ds, dkr = _tile_gradients(q, k, v, d_symbols, lse, delta, visible, dkr, QR, KR, D_RELATIONS, b,
                                         offs_m, sqr_b, sqr_m, sqr_l, q_len, offs_n, skr_b, skr_n, skr_l, kv_len,
                                         offs_c, heads, num_heads, head_ok, qk_scale, relation_scaling,
                                         NUM_RELATIONS, RELATION_DIM, R_PAD, True, PRECISION, WIDEN)
            dv += _dot(tl.permute(p.to(d_symbols.dtype), (0, 2, 1)), d_symbols, PRECISION, WIDEN)  # P^T dSymbols
            dk += _dot(tl.permute(ds.to(q.dtype), (0, 2, 1)), q, PRECISION, WIDEN)  # dS^T Q
    rows = (b * num_heads + heads[:, None, None]) * kv_len + offs_n[None, :, None]  # [b, h, kv, d_h]
    inside = head_ok[:, None, None] & (offs_n < kv_len)[None, :, None] & (offs_d < HEAD_DIM)[None, None, :]
    tl.store(DK + rows * HEAD_DIM + offs_d[None, None, :], dk * scaling, mask=inside)
    tl.store(DV + rows * HEAD_DIM + offs_d[None, None, :], dv, mask=inside)
    _store_relation_gradients(DKR, dkr, slot, offs_n, kv_len, offs_c, NUM_RELATIONS, RELATION_DIM, R_PAD)


@triton.autotune(configs=_RECEIVER_CONFIGS, key=_TUNING_KEY)
@triton.jit
def _backward_dq_kernel(Q, K, V, QR, KR, MASK, D_SYMBOLS, D_RELATIONS, LSE, DELTA, DQ, DQR,
                        sq_b, sq_h, sq_m, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, sqr_b, sqr_m, sqr_l, skr_b, skr_n,
                        skr_l, sm_b, sm_m, sm_n, num_heads, q_len, kv_len, offset, window_lo, window_hi, qk_scale,
                        scaling, relation_scaling, HEADS: tl.constexpr, GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr,
                        NUM_RELATIONS: tl.constexpr, RELATION_DIM: tl.constexpr, D_PAD: tl.constexpr,
                        R_PAD: tl.constexpr, DR_PAD: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                        HAS_MASK: tl.constexpr, PRECISION: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """dQ `[b, h, q, d_h]` and dQ_rel `[chunks, b, q, R, d_r]` (float32) of one block of receivers, walking the
    senders it sees."""
    b, slot, heads, head_ok = _program_heads(num_heads, HEADS)
    q0 = tl.program_id(0) * BLOCK_M
    offs_m = q0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_c = tl.arange(0, DR_PAD)
    q, d_symbols, lse, delta = _receiver_tiles(Q, D_SYMBOLS, LSE, DELTA, b, heads, sq_b, sq_h, sq_m, offs_m, q_len,
                                               offs_d, num_heads, HEAD_DIM, head_ok)
    dq = tl.zeros([HEADS, BLOCK_M, D_PAD], tl.float32)
    dqr = tl.zeros([R_PAD, BLOCK_M, DR_PAD], tl.float32)
    start, end = _sender_range(q0, q_len, kv_len, offset, window_lo, window_hi, CAUSAL, WINDOWED, BLOCK_M, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        visible = _visible(MASK, b * sm_b, sm_m, sm_n, offs_m, offs_n, q_len, kv_len, offset,
                           window_lo, window_hi, CAUSAL, WINDOWED, HAS_MASK)
        if tl.max(visible.to(tl.int32)) > 0:
            k, v = _sender_tiles(K, V, b, heads // GROUPS, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, offs_n, kv_len, offs_d,
                                 HEAD_DIM, head_ok)
            p, ds, dqr = _tile_gradients(q, k, v, d_symbols, lse, delta, visible, dqr, QR, KR, D_RELATIONS, b,
                                         offs_m, sqr_b, sqr_m, sqr_l, q_len, offs_n, skr_b, skr_n, skr_l, kv_len,
                                         offs_c, heads, num_heads, head_ok, qk_scale, relation_scaling,
                                         NUM_RELATIONS, RELATION_DIM, R_PAD, False, PRECISION, WIDEN)
            dq += _dot(ds.to(k.dtype), k, PRECISION, WIDEN)  # dS K
    rows = (b * num_heads + heads[:, None, None]) * q_len + offs_m[None, :, None]  # [b, h, q, d_h]
    tl.store(DQ + rows * HEAD_DIM + offs_d[None, None, :], (dq * scaling).to(DQ.dtype.element_ty),
             mask=head_ok[:, None, None] & (offs_m < q_len)[None, :, None] & (offs_d < HEAD_DIM)[None, None, :])
    _store_relation_gradients(DQR, dqr, slot, offs_m, q_len, offs_c, NUM_RELATIONS, RELATION_DIM, R_PAD)


# ---- launching -----------------------------------------------------------------------------------------------------
def _contiguous_last(x):
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_inputs(query, key, values, q_rel, k_rel, mask, causal, window):
    names = ("query", "key", "symbol values", "relation queries", "relation keys")
    tensors = (query, key, values, q_rel, k_rel)
    for name, x in zip(names, tensors):
        if x.dim() != 4 or x.dtype != query.dtype or x.device != query.device or x.shape[0] != query.shape[0]:
            raise ValueError(f"relational attention (triton): {name} must be a 4-d {query.dtype} tensor on "
                             f"{query.device} with the query's batch size, got {x.dtype} {list(x.shape)} on {x.device}")
    b, h, q_len, d = query.shape
    if query.dtype not in _DTYPES:
        raise ValueError(f"relational attention (triton): float32, float16 or bfloat16 inputs, got {query.dtype}")
    if key.shape != values.shape or key.shape[3] != d or h % key.shape[1] != 0:
        raise ValueError("relational attention (triton): key and symbol values must be [b, h_kv, kv, d_h] with h "
                         f"divisible by h_kv; got query {list(query.shape)}, key {list(key.shape)}, symbol values "
                         f"{list(values.shape)}")
    if q_rel.shape[1] != q_len or k_rel.shape[1] != key.shape[2] or q_rel.shape[2:] != k_rel.shape[2:]:
        raise ValueError(f"relational attention (triton): relation queries [b, q, R, d_r] and keys [b, kv, R, d_r] "
                         f"do not match query {list(query.shape)} / key {list(key.shape)}: got {list(q_rel.shape)} "
                         f"and {list(k_rel.shape)}")
    if causal and key.shape[2] < q_len:
        raise ValueError("relational attention (triton): causal attention needs kv_len >= q_len")
    kv_len = key.shape[2]
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1
                             or mask.shape[0] not in (1, b) or mask.shape[2] not in (1, q_len)
                             or mask.shape[3] != kv_len or mask.device != query.device):
        raise ValueError(f"relational attention (triton): the mask must be bool [b|1, 1, q|1, kv] = [{b}|1, 1, "
                         f"{q_len}|1, {kv_len}] (True = attend) on {query.device}, got {mask.dtype} "
                         f"{list(mask.shape)} on {mask.device}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ValueError(f"relational attention (triton): the window must be None or an int >= 0 (the previous "
                         f"tokens a receiver sees), got {window!r}")


def _launch(query, key, values, q_rel, k_rel, mask, causal, window, two_sided):
    """(head chunks, the kernels' shared arguments after the pointers, their constexprs)."""
    _, h, q_len, d = query.shape
    kv_len, R, d_r = key.shape[2], q_rel.shape[2], q_rel.shape[3]
    heads = min(triton.next_power_of_2(h), HEADS_PER_PROGRAM)
    strides = (*query.stride()[:3], *key.stride()[:3], *values.stride()[:3], *q_rel.stride()[:3],
               *k_rel.stride()[:3])
    if mask is None:
        mask_strides = (0, 0, 0)
    else:  # broadcast dims read with stride 0
        mask_strides = (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2) if mask.shape[2] > 1 else 0,
                        mask.stride(3))
    # receiver i at position p = offset + i sees senders p - window_lo <= j <= p + window_hi: its `window` previous
    # tokens and itself, p - window <= j <= p, or |p - j| <= window (two-sided); window None: none (bounds unused)
    window_lo, window_hi = (0, 0) if window is None else (window, window if two_sided else 0)
    shared = (*strides, *mask_strides, h, q_len, kv_len, receiver_offset(q_len, kv_len), window_lo, window_hi)
    constants = dict(
        HEADS=heads, GROUPS=h // key.shape[1], HEAD_DIM=d, NUM_RELATIONS=R, RELATION_DIM=d_r,
        D_PAD=max(16, triton.next_power_of_2(d)), R_PAD=triton.next_power_of_2(R),
        DR_PAD=max(16, triton.next_power_of_2(d_r)), CAUSAL=bool(causal), WINDOWED=window is not None,
        HAS_MASK=mask is not None,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        WIDEN=INTERPRETED and query.dtype == torch.bfloat16,
    )
    return triton.cdiv(h, heads), shared, constants


def _current(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' (a model spread over GPUs by `device_map`
    calls the op with tensors on any of them)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _receiver_grid(q_len, rows, splits=1):
    return lambda meta: (triton.cdiv(q_len, meta["BLOCK_M"]), rows, splits)


# senders of a split: at least this many, a multiple of every BLOCK_N
SPLIT_SENDERS = 256


@functools.cache
def _processors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 elsewhere: the interpreter's CPU tensors)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _sender_splits(q_len: int, kv_len: int, rows: int, device: torch.device) -> tuple[int, int]:
    """(splits, senders per split) of a forward: the senders go to several programs (flash-decoding), whose outputs
    `_combine_splits` joins, where the blocks of receivers alone would leave most of the GPU idle: a decoding step
    (one block per batch row and head chunk) over a long cache. At least `SPLIT_SENDERS` senders per split."""
    programs = triton.cdiv(q_len, 16) * rows  # (BLOCK_M is at least 16)
    splits = max(1, min(triton.cdiv(kv_len, SPLIT_SENDERS), triton.cdiv(2 * _processors(device), programs)))
    size = triton.cdiv(triton.cdiv(kv_len, splits), SPLIT_SENDERS) * SPLIT_SENDERS
    return triton.cdiv(kv_len, size), size


@triton.jit
def _combine_kernel(SYMBOLS, RELATIONS, LSE, OUT_SYMBOLS, OUT_RELATIONS, OUT_LSE, splits, num_heads, q_len,
                    HEAD_DIM: tl.constexpr, NUM_RELATIONS: tl.constexpr, S_PAD: tl.constexpr, D_PAD: tl.constexpr,
                    R_PAD: tl.constexpr):
    """One (b, i, h) of the outputs from the splits' (program = its index in `[b, q, h]` order): split s weighs
    exp2(lse_s - lse), lse = log2 sum_s exp2(lse_s); a split without senders (lse +inf) weighs 0."""
    row = tl.program_id(0).to(tl.int64)
    rows = tl.num_programs(0)
    h = row % num_heads
    b = row // num_heads // q_len
    i = row // num_heads % q_len
    s = tl.arange(0, S_PAD)
    lse = tl.load(LSE + s * rows + (b * num_heads + h) * q_len + i, mask=s < splits, other=float("inf"))
    lse = tl.where(lse < float("inf"), lse, float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # (no sender in any split: every weight 0)
    weights = tl.exp2(lse - top)
    total = tl.sum(weights, axis=0)
    weights = weights * tl.where(total > 0, 1.0 / tl.where(total > 0, total, 1.0), 0.0)
    offs_d = tl.arange(0, D_PAD)
    symbols = tl.load(SYMBOLS + s[:, None] * rows * HEAD_DIM + row * HEAD_DIM + offs_d[None, :],
                      mask=(s < splits)[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    tl.store(OUT_SYMBOLS + row * HEAD_DIM + offs_d, tl.sum(symbols * weights[:, None], axis=0).to(
        OUT_SYMBOLS.dtype.element_ty), mask=offs_d < HEAD_DIM)
    offs_r = tl.arange(0, R_PAD)
    relations = tl.load(RELATIONS + s[:, None] * rows * NUM_RELATIONS + row * NUM_RELATIONS + offs_r[None, :],
                        mask=(s < splits)[:, None] & (offs_r < NUM_RELATIONS)[None, :], other=0.0)
    tl.store(OUT_RELATIONS + row * NUM_RELATIONS + offs_r, tl.sum(relations * weights[:, None], axis=0).to(
        OUT_RELATIONS.dtype.element_ty), mask=offs_r < NUM_RELATIONS)
    lse = tl.where(total > 0, top + tl.log2(tl.where(total > 0, total, 1.0)), float("inf"))
    tl.store(OUT_LSE + (b * num_heads + h) * q_len + i, lse)


def _combine_splits(symbols, relations, lse, dtype):
    """Outputs of the splits, each over its own senders (symbols `[S, b, q, h, d_h]`, relations `[S, b, q, h, R]`,
    float32; log-sum-exp `[S, b, h, q]`, base 2, +inf for a receiver with no sender in the split) -> the outputs over
    every sender, in `dtype`, and their log-sum-exp (one launch)."""
    splits, b, q_len, h, d = symbols.shape
    R = relations.shape[-1]
    out_symbols, out_relations = symbols.new_empty(b, q_len, h, d, dtype=dtype), relations.new_empty(
        b, q_len, h, R, dtype=dtype)
    out_lse = torch.empty(b, h, q_len, device=lse.device, dtype=torch.float32)
    _combine_kernel[(b * q_len * h,)](symbols, relations, lse, out_symbols, out_relations, out_lse, splits, h, q_len,
                                      HEAD_DIM=d, NUM_RELATIONS=R, S_PAD=triton.next_power_of_2(splits),
                                      D_PAD=triton.next_power_of_2(d), R_PAD=triton.next_power_of_2(R))
    return out_symbols, out_relations, out_lse


@torch.library.custom_op("dat_hf::triton_relational_forward", mutates_args=())
def _forward_op(query: torch.Tensor, key: torch.Tensor, values: torch.Tensor, q_rel: torch.Tensor,
                k_rel: torch.Tensor, mask: torch.Tensor | None, causal: bool, window: int | None, two_sided: bool,
                scaling: float, relation_scaling: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, q_len, d = query.shape
    chunks, shared, constants = _launch(query, key, values, q_rel, k_rel, mask, causal, window, two_sided)
    splits, split_size = _sender_splits(q_len, key.shape[2], b * chunks, query.device)
    dtype = query.dtype if splits == 1 else torch.float32  # (the splits' outputs, combined in float32)
    symbols = query.new_empty(splits, b, q_len, h, d, dtype=dtype)
    relations = query.new_empty(splits, b, q_len, h, q_rel.shape[2], dtype=dtype)
    lse = torch.empty(splits, b, h, q_len, device=query.device, dtype=torch.float32)
    with _current(query.device):
        _forward_kernel[_receiver_grid(q_len, b * chunks, splits)](
            query, key, values, q_rel, k_rel, query if mask is None else mask, symbols, relations, lse, *shared,
            scaling * LOG2E, relation_scaling, split_size, **constants)
        if splits == 1:
            return symbols[0], relations[0], lse[0]
        return _combine_splits(symbols, relations, lse, query.dtype)


@_forward_op.register_fake
def _(query, key, values, q_rel, k_rel, mask, causal, window, two_sided, scaling, relation_scaling):
    b, h, q_len, d = query.shape
    return (query.new_empty(b, q_len, h, d), query.new_empty(b, q_len, h, q_rel.shape[2]),
            query.new_empty(b, h, q_len, dtype=torch.float32))


@torch.library.custom_op("dat_hf::triton_relational_backward", mutates_args=())
def _backward_op(grad_symbols: torch.Tensor, grad_relations: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                 values: torch.Tensor, q_rel: torch.Tensor, k_rel: torch.Tensor, symbols: torch.Tensor,
                 relations: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor | None, causal: bool,
                 window: int | None, two_sided: bool, scaling: float, relation_scaling: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    b, h, q_len, d = query.shape
    h_kv, kv_len, R, d_r = key.shape[1], key.shape[2], q_rel.shape[2], q_rel.shape[3]
    grad_symbols, grad_relations = grad_symbols.contiguous(), grad_relations.contiguous()
    # D = <dSymbols, symbols> + <dRelations, relations>: [b, h, q]
    delta = ((grad_symbols.float() * symbols.float()).sum(-1) + (grad_relations.float() * relations.float()).sum(-1))
    delta = delta.transpose(1, 2).contiguous()
    chunks, shared, constants = _launch(query, key, values, q_rel, k_rel, mask, causal, window, two_sided)
    f32 = dict(device=query.device, dtype=torch.float32)
    d_key, d_values = torch.empty(b, h, kv_len, d, **f32), torch.empty(b, h, kv_len, d, **f32)  # per query head
    d_k_rel, d_q_rel = torch.empty(chunks, b, kv_len, R, d_r, **f32), torch.empty(chunks, b, q_len, R, d_r, **f32)
    d_query = torch.empty(query.shape, device=query.device, dtype=query.dtype)  # [b, h, q, d_h], contiguous
    inputs = (query, key, values, q_rel, k_rel, query if mask is None else mask, grad_symbols, grad_relations, lse,
              delta)
    scales = (scaling * LOG2E, scaling, relation_scaling)
    with _current(query.device):
        _backward_dkv_kernel[lambda meta: (triton.cdiv(kv_len, meta["BLOCK_N"]), b * chunks)](
            *inputs, d_key, d_values, d_k_rel, *shared, *scales, **constants)
        _backward_dq_kernel[_receiver_grid(q_len, b * chunks)](
            *inputs, d_query, d_q_rel, *shared, *scales, **constants)
    groups = h // h_kv  # the query heads of a kv head sum their key and value gradients

    def per_kv_head(grad):
        return grad.view(b, h_kv, groups, kv_len, d).sum(2).to(key.dtype)

    return (d_query, per_kv_head(d_key), per_kv_head(d_values), d_q_rel.sum(0).to(q_rel.dtype),
            d_k_rel.sum(0).to(k_rel.dtype))


@_backward_op.register_fake
def _(grad_symbols, grad_relations, query, key, values, q_rel, k_rel, symbols, relations, lse, mask, causal, window,
      two_sided, scaling, relation_scaling):
    return tuple(t.new_empty(t.shape) for t in (query, key, values, q_rel, k_rel))


_setup_context, _backward = relational_op_autograd(_backward_op)
_forward_op.register_autograd(_backward, setup_context=_setup_context)


def relational_attention_op(query, key, values, q_rel, k_rel, causal: bool, scaling: float, relation_scaling: float,
                            mask=None, window: int | None = None, two_sided: bool = False):
    """query `[b, h, q, d_h]`, key and symbol values `[b, h_kv, kv, d_h]` (GQA: h divisible by h_kv; values may be
    expanded over the batch), relation queries `[b, q, R, d_r]`, relation keys `[b, kv, R, d_r]`, one dtype (float32,
    float16 or bfloat16) on CUDA (CPU under `TRITON_INTERPRET=1`). Receiver i sits at position p = kv - q + i;
    causal: it sees senders j <= p; window (None or an int >= 0, dat_hf's convention: `sliding_window_size`): it sees
    its `window` previous tokens and itself, p - window <= j <= p, or, two_sided, |p - j| <= window, by index
    arithmetic (0: itself only); mask: None or bool `[b|1, 1, q|1, kv]` (True = attend, intersected with causal order
    and window when given with them: the backend passes causal order only without a mask, the mask rule;
    a receiver without senders gets zeros and zero gradients) -> attended symbols `[b, q, h, d_h]`, attended relations
    `[b, q, h, R]` (scaled by `relation_scaling`). Differentiable w.r.t. the five inputs."""
    _check_inputs(query, key, values, q_rel, k_rel, mask, causal, window)
    symbols, relations, _ = _forward_op(*(_contiguous_last(t) for t in (query, key, values, q_rel, k_rel)), mask,
                                        bool(causal), window, bool(two_sided), float(scaling),
                                        float(relation_scaling))
    return symbols, relations


# ---- the backend ---------------------------------------------------------------------------------------------------
# what a kernel that cannot be built or launched on a device raises, besides Triton's own errors (`triton.*` classes:
# CompilationError, OutOfResources, PTXASError, ...): messages of the driver's launcher and of MLIR's pass manager
_KERNEL_FAILURE_TEXT = ("Triton Error", "PassManager::run failed", "ptxas")
# the kernel variants (device, dtype, constexprs) whose backward kernels have run in this process
_CHECKED_BACKWARD: set = set()


def kernel_failure(error: BaseException) -> bool:
    """Whether `error` says that a Triton kernel failed to compile or launch (not an input error, not CUDA memory)."""
    if isinstance(error, (ValueError, torch.OutOfMemoryError)):
        return False
    return type(error).__module__.split(".")[0] == "triton" or (
        isinstance(error, RuntimeError) and any(text in str(error) for text in _KERNEL_FAILURE_TEXT))


def _check_backward(query, key, values, q_rel, k_rel, mask, causal, window, two_sided, scaling, relation_scaling):
    """Before the first training call of a kernel variant (device, dtype, constexprs) in this process: a forward and a
    backward on the call's own tensors (detached; zero output gradients), so that a backward kernel that cannot be
    built or launched fails in the forward, where the backend can still give way, not in `loss.backward()`. On the
    call's shapes: the autotuner tunes each kernel on them, as the real call would."""
    _, _, constants = _launch(query, key, values, q_rel, k_rel, mask, causal, window, two_sided)
    variant = (str(query.device), query.dtype, tuple(sorted(constants.items())))
    if variant in _CHECKED_BACKWARD:
        return
    with torch.no_grad():
        args = [_contiguous_last(t.detach()) for t in (query, key, values, q_rel, k_rel)]
        options = (mask, bool(causal), window, bool(two_sided), float(scaling), float(relation_scaling))
        symbols, relations, lse = _forward_op(*args, *options)
        _backward_op(torch.zeros_like(symbols), torch.zeros_like(relations), *args, symbols, relations, lse, *options)
    _CHECKED_BACKWARD.add(variant)


def triton_relational_attention(query, key, symbol_values, relation_queries, relation_keys, relation_proj,
                                attention_mask, spec, dropout=0.0, **kwargs):
    """The `"triton"` backend (signature and outputs as `eager_relational_attention`; the mask a `KernelMask`). Inputs
    are cast to the autocast dtype under autocast. With a mask, the mask alone decides who attends (as in the
    reference; the mask rule of `masking_dat.AttentionMask`: causal order only without a mask); a sliding window
    over the whole sequence (`KernelMask.window`, with the padding as its mask) goes to the kernel as its window (its
    own side decides causal order), never as a dense mask. A kernel that fails to compile or launch raises
    `RelationalBackendUnavailable` naming the error (the backward kernels are run once per kernel variant before the
    first training call, see `_check_backward`), so that automatic selection falls back to the next backend."""
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    query, key, symbol_values, relation_queries, relation_keys = (
        t.to(dtype) for t in (query, key, symbol_values, relation_queries, relation_keys))
    scaling, relation_scaling = spec.scaling, spec.relation_scaling
    mask, window = attention_mask.mask, attention_mask.window
    if window is None:
        causal, window_args = attention_mask.is_causal and mask is None, {}
    else:
        causal, window_args = not window.two_sided, dict(window=window.previous, two_sided=window.two_sided)
    symbol_values = symbol_values.expand(query.shape[0], -1, -1, -1)
    try:
        if torch.is_grad_enabled() and not torch.compiler.is_compiling() and any(
                t.requires_grad for t in (query, key, symbol_values, relation_queries, relation_keys)):
            _check_inputs(query, key, symbol_values, relation_queries, relation_keys, mask, causal,
                          window_args.get("window"))
            _check_backward(query, key, symbol_values, relation_queries, relation_keys, mask, causal,
                            window_args.get("window"), window_args.get("two_sided", False), scaling, relation_scaling)
        attended_symbols, attended_relations = relational_attention_op(
            query, key, symbol_values, relation_queries, relation_keys, causal, scaling, relation_scaling, mask,
            **window_args)
    except Exception as error:
        if not kernel_failure(error):
            raise
        raise RelationalBackendUnavailable(
            f"The Triton relational attention kernel failed to compile or launch on {query.device} ({query.dtype}): "
            f"{type(error).__name__}: {error}") from error
    messages = relational_output(attended_symbols, attended_relations, relation_proj, dtype)
    return messages, None, None


def supports_triton(call: RelationalCall) -> str | None:
    """What the Triton kernel runs: CUDA tensors (CPU ones only under `TRITON_INTERPRET=1`), float32, float16 or
    bfloat16, identity relations, symbols per sender, no attention dropout or weights, no mask or a bool one."""
    if call.device != "cuda" and not (INTERPRETED and call.device == "cpu"):
        return "the Triton kernel runs on CUDA (on CPU only under TRITON_INTERPRET=1)"
    if call.dtype not in _DTYPES:
        return f"the Triton kernel runs float32, float16 or bfloat16, not {call.dtype}"
    if (reason := fused_values_limits(call)) is not None:
        return reason
    if call.dropout > 0:
        return "the Triton kernel has no attention dropout"
    if not call.mask.bool_or_none:
        return "the Triton kernel takes no mask or a bool [b|1, 1, q|1, kv] one"
    return None


def register():
    """Register the `"triton"` backend, tried first on CUDA by automatic selection; it takes a long sliding window
    over the whole sequence in one call."""
    RELATIONAL_ATTENTION_FUNCTIONS.register("triton", triton_relational_attention, supports_triton,
                                            preferred_on=("cuda",), mask_format="window")


__all__ = ["INTERPRETED", "kernel_failure", "relational_attention_op", "register", "supports_triton",
           "triton_relational_attention"]
