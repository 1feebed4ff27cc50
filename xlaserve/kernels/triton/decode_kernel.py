"""The Triton decode kernel body, in Triton's own language (imported only on GPU).

Same algorithm and layout as the Pallas kernel in `kernels/paged_attention.py`: one program per
(row, kv head, split); the group's Gp query heads share every K/V load; partial (o, m, l) per
split, merged by the wrapper.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    layer_ptr,      # [1] int32
    kv_lens_ptr,    # [B] int32
    tables_ptr,     # [B, WIDTH] int32, padded with block 0
    q_ptr,          # [B, KVH, GP, D]
    k_ptr,          # [L, NUM_BLOCKS, BS, KVH, D]: whole stacked cache, read in place
    v_ptr,          # [L, NUM_BLOCKS, BS, KVH, D]
    o_ptr,          # [S, B, KVH, GP, D] float32: unnormalised partial outputs
    m_ptr,          # [S, B, KVH, GP] float32: running max per split
    l_ptr,          # [S, B, KVH, GP] float32: softmax denominator per split
    SCALE: tl.constexpr,
    SOFT_CAP: tl.constexpr,      # 0.0: no cap
    BATCH: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,
    BS: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    GP: tl.constexpr,
    WIDTH: tl.constexpr,
    PAGES: tl.constexpr,          # KV blocks per compute block
    PAGES_PER_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,      # "ieee" for float32 inputs (no TF32), else "tf32" (ignored)
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    BLOCK_K: tl.constexpr = PAGES * BS
    layer = tl.load(layer_ptr).to(tl.int64)
    kv_len = tl.load(kv_lens_ptr + b)
    num_pages = tl.cdiv(kv_len, BS)
    first = s * PAGES_PER_SPLIT
    last = tl.minimum(first + PAGES_PER_SPLIT, num_pages)

    g = tl.arange(0, GP)                                                       # [GP]
    d = tl.arange(0, D)                                                        # [D]
    kk = tl.arange(0, BLOCK_K)                                                 # [BLOCK_K]
    page_of = kk // BS
    slot_in_block = kk % BS
    q_rows = (b * KVH + h) * GP + g
    q = tl.load(q_ptr + q_rows[:, None] * D + d[None, :])                     # [GP, D]

    m = tl.full([GP], -1e30, tl.float32)
    l = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    for page in range(first, last, PAGES):
        page_idx = page + page_of                                             # [BLOCK_K]
        ids = tl.load(tables_ptr + b * WIDTH + page_idx, mask=page_idx < num_pages, other=0)
        ids = tl.minimum(tl.maximum(ids, 0), NUM_BLOCKS - 1).to(tl.int64)
        rows = ((layer * NUM_BLOCKS + ids) * BS + slot_in_block) * KVH + h    # [BLOCK_K]
        k = tl.load(k_ptr + rows[:, None] * D + d[None, :])                   # [BLOCK_K, D]
        v = tl.load(v_ptr + rows[:, None] * D + d[None, :])                   # [BLOCK_K, D]
        logits = tl.dot(q, tl.trans(k), input_precision=PRECISION) * SCALE    # [GP, BLOCK_K]
        if SOFT_CAP > 0:
            # tanh(x) = 2 sigmoid(2x) - 1, in core tl on every Triton release.
            logits = SOFT_CAP * (2.0 * tl.sigmoid(2.0 * logits / SOFT_CAP) - 1.0)
        key_pos = page * BS + kk
        logits = tl.where((key_pos < kv_len)[None, :], logits, -1e30)
        m_next = tl.maximum(m, tl.max(logits, 1))
        correction = tl.exp(m - m_next)
        p = tl.exp(logits - m_next[:, None])
        l = l * correction + tl.sum(p, 1)
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_next

    part = (s * BATCH + b) * KVH + h
    tl.store(o_ptr + (part * GP + g)[:, None] * D + d[None, :], acc)
    tl.store(m_ptr + part * GP + g, m)
    tl.store(l_ptr + part * GP + g, l)
