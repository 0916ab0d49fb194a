"""The Gluon program of :mod:`.codes_wgmma` (attention forward on the exchange's 8-bit codes
with Hopper's asynchronous warpgroup MMA): the same math and outputs as
:mod:`.codes_attention` (see its docstring for the exponent's folded scales and the error of
P in e4m3), scheduled explicitly.

Schedule of one program (128 query rows of one head):

* a loader partition (the default warps) brings the 128 Q rows once and the K tile
  [BLOCK_N, D] and V^T tile [D, BLOCK_N] of each key block through a ring of ``STAGES``
  shared-memory slots with the tensor memory accelerator (one barrier a slot says "full",
  one says "free");
* two consumer warpgroups, 64 query rows each, run the key loop on the same ring: Q·K^T is
  one int8 warpgroup MMA into an int32 accumulator that starts at the bits of ``1.5 * 2^23``
  (so the scores are floats after a bit cast), the softmax is fp32, P is rounded to e4m3 and
  P·V is one fp8 warpgroup MMA on the transposed V; the two warpgroups overlap each other's
  MMAs and softmax. ``UPDATE`` key blocks (1, 2 or 4) share one row max and one rescale of
  the accumulator; with ``LAZY`` the rescale waits until a row max of the warpgroup grew by
  more than ``LAZY_GROWTH`` (log2 units), so it is skipped for most blocks of a long row;
  with ``PIPE`` a consumer issues the scores of block ``j`` and P·V of block ``j - 1``
  together and runs the softmax of ``j`` while the tensor cores work on ``j - 1``.

The instructions a key block costs bound the speed (the MMAs are half the tensor cores' time
of bf16): per 64 keys and thread, the seed copies of the score accumulator, one FMA and one
exp2 a score, its row sum, the e4m3 packing, the row max and the rescale. ``UPDATE`` and
``LAZY`` remove the per-block shares of the last two.
"""

from __future__ import annotations

try:  # Gluon (Triton >= 3.5); the module imports without it and reports the reason
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.6 names the TMA load async_copy_global_to_shared; later ones async_load
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    GLUON_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the installed Triton
    gl = TensorDescriptor = None
    GLUON_ERROR = f"Triton's Gluon for Hopper is not available: {e}"

__all__ = ["BIAS_BITS", "BLOCK_M", "BLOCK_N", "GLUON_ERROR", "LOG2E", "TensorDescriptor", "gl"]

LOG2E = 1.4426950408889634
# the bits of 1.5 * 2^23: int32 k added to them are the bits of the float 1.5 * 2^23 + k
BIAS_BITS = 0x4B400000
BLOCK_M = 64  # query rows of one consumer warpgroup (the warpgroup MMA's M)
BLOCK_N = 64  # keys of one ring slot (one K group of 64 rows, or several slots a group)


if GLUON_ERROR is None:
    LN2 = gl.constexpr(0.6931471805599453)
    _BIAS = gl.constexpr(12582912.0)
    _BLOCK_M = gl.constexpr(BLOCK_M)
    _BLOCK_N = gl.constexpr(BLOCK_N)
    # log2 units a row max may grow before a lazy rescale (margin for the folded constant)
    LAZY_GROWTH = gl.constexpr(0.5)

    @gluon.jit
    def _load_partition(
        desc_q, desc_k, desc_vt, q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty,
        q_row, q_col, k_row, k_col, vt_row, n_blocks,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        mbarrier.expect(q_bar, desc_q.block_type.nbytes)
        _tma_load(desc_q, [q_row, q_col], q_bar, q_smem)
        for i in range(n_blocks):
            s = i % STAGES
            # a fresh barrier is in phase 0: waiting for phase 1 passes at once (first round)
            mbarrier.wait(kv_empty.index(s), ((i // STAGES) & 1) ^ 1)
            bar = kv_ready.index(s)
            mbarrier.expect(bar, desc_k.block_type.nbytes + desc_vt.block_type.nbytes)
            _tma_load(desc_k, [k_row + i * BLOCK_N, k_col], bar,
                                            k_smem.index(s))  # fmt: skip
            _tma_load(desc_vt, [vt_row, i * BLOCK_N], bar,
                                            v_smem.index(s))  # fmt: skip

    @gluon.jit
    def _k_scale(ks_ptr, n, k_group):
        """The K scale of the key block at key ``n``."""
        return gl.load(ks_ptr + n // k_group)

    @gluon.jit
    def _softmax_block(
        bits, m_i, l_i, a_row, ks_ptr, k_group, start_n, o_n, o_m, hi_k,
        MASKED: gl.constexpr, CAUSAL: gl.constexpr,
    ):  # fmt: skip
        """P (fp32, times 2^8) of one key block from the biased int32 scores; the new max,
        the running sum rescaled, and alpha (the accumulator's factor)."""
        b_ab = a_row * _k_scale(ks_ptr, start_n, k_group)  # one a key block
        if MASKED:
            x = bits.to(gl.float32, bitcast=True) - _BIAS
            o_c = start_n + o_n
            valid = gl.expand_dims(o_c < hi_k, 0)
            if CAUSAL:
                valid = valid & (gl.expand_dims(o_c, 0) <= gl.expand_dims(o_m, 1))
            x = gl.where(valid, x * gl.expand_dims(b_ab, 1), float("-inf"))
            m_new = gl.maximum(m_i, gl.max(x, 1))
            m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key so far
            p = gl.exp2(x + gl.expand_dims(8.0 - m_use, 1))
        else:
            b_mx = gl.max(bits, 1).to(gl.float32, bitcast=True) - _BIAS
            m_new = gl.maximum(m_i, b_mx * b_ab)
            m_use = m_new
            b_c = 8.0 - m_use - _BIAS * b_ab  # 2^(x a - m + 8), x = bits - 1.5 2^23
            p = gl.exp2(gl.fma(bits.to(gl.float32, bitcast=True), gl.expand_dims(b_ab, 1),
                               gl.expand_dims(b_c, 1)))  # fmt: skip
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _one_block(
        q_c, k_smem, v_smem, kv_ready, kv_empty, bias, acc, m_i, l_i, a_row, ks_ptr, k_group,
        i, o_n, o_m, hi_k, p_layout: gl.constexpr,
        row_o: gl.constexpr, STAGES: gl.constexpr,
        BLOCK_N: gl.constexpr, MASKED: gl.constexpr, CAUSAL: gl.constexpr,
    ):  # fmt: skip
        """Key block ``i`` folded into (acc, m_i, l_i), nothing left in flight."""
        s = i % STAGES
        mbarrier.wait(kv_ready.index(s), (i // STAGES) & 1)
        bits = warpgroup_mma(q_c, k_smem.index(s).permute((1, 0)), bias, is_async=True)
        bits = warpgroup_mma_wait(num_outstanding=0, deps=(bits,))
        p, m_i, l_i, alpha = _softmax_block(bits, m_i, l_i, a_row, ks_ptr, k_group,
                                            i * BLOCK_N, o_n, o_m, hi_k, MASKED,
                                            CAUSAL)  # fmt: skip
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        acc = warpgroup_mma(p8, v_smem.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(s), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _pipelined_blocks(
        q_c, k_smem, v_smem, kv_ready, kv_empty, bias, acc, m_i, l_i, a_row, ks_ptr, k_group,
        n, o_n, o_m, hi_k, p_layout: gl.constexpr,
        row_o: gl.constexpr, STAGES: gl.constexpr,
        BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr,
    ):  # fmt: skip
        """Unmasked key blocks ``[0, n)`` (n >= 1), one ahead: the scores of block ``i`` and
        P·V of block ``i - 1`` are issued together, the softmax of ``i`` runs while P·V of
        ``i - 1`` is in flight."""
        mbarrier.wait(kv_ready.index(0), 0)
        bits = warpgroup_mma(q_c, k_smem.index(0).permute((1, 0)), bias, is_async=True)
        bits = warpgroup_mma_wait(num_outstanding=0, deps=(bits,))
        p, m_i, l_i, alpha = _softmax_block(bits, m_i, l_i, a_row, ks_ptr, k_group,
                                            0, o_n, o_m, hi_k, False,
                                            CAUSAL)  # fmt: skip
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
        p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        for i in range(1, n):
            s = i % STAGES
            s_prev = (i - 1) % STAGES
            mbarrier.wait(kv_ready.index(s), (i // STAGES) & 1)
            bits = warpgroup_mma(q_c, k_smem.index(s).permute((1, 0)), bias, is_async=True)
            acc = warpgroup_mma(p8, v_smem.index(s_prev).permute((1, 0)), acc, is_async=True)
            bits = warpgroup_mma_wait(num_outstanding=1, deps=(bits,))
            p, m_i, l_i, alpha = _softmax_block(bits, m_i, l_i, a_row, ks_ptr, k_group,
                                                i * BLOCK_N, o_n, o_m, hi_k, False,
                                                CAUSAL)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(kv_empty.index(s_prev), count=1)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p8 = gl.convert_layout(p.to(gl.float8e4nv), p_layout)
        s_last = (n - 1) % STAGES
        acc = warpgroup_mma(p8, v_smem.index(s_last).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(kv_empty.index(s_last), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _softmax_pair(bits0, bits1, m_i, l_i, a_row, ks_ptr, k_group, start_n,
                      BLOCK_N: gl.constexpr):  # fmt: skip
        """:func:`_softmax_block` of two unmasked key blocks at once: one max, one alpha."""
        ab0 = a_row * _k_scale(ks_ptr, start_n, k_group)
        ab1 = a_row * _k_scale(ks_ptr, start_n + BLOCK_N, k_group)
        mx0 = gl.max(bits0, 1).to(gl.float32, bitcast=True) - _BIAS
        mx1 = gl.max(bits1, 1).to(gl.float32, bitcast=True) - _BIAS
        m_new = gl.maximum(m_i, gl.maximum(mx0 * ab0, mx1 * ab1))
        c0 = 8.0 - m_new - _BIAS * ab0
        c1 = 8.0 - m_new - _BIAS * ab1
        p0 = gl.exp2(gl.fma(bits0.to(gl.float32, bitcast=True), gl.expand_dims(ab0, 1),
                            gl.expand_dims(c0, 1)))  # fmt: skip
        p1 = gl.exp2(gl.fma(bits1.to(gl.float32, bitcast=True), gl.expand_dims(ab1, 1),
                            gl.expand_dims(c1, 1)))  # fmt: skip
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + (gl.sum(p0, 1) + gl.sum(p1, 1))
        return p0, p1, m_new, l_i, alpha

    @gluon.jit
    def _pair_scores(q_c, k_smem, kv_ready, bias, i0, STAGES: gl.constexpr):
        """The scores of key blocks ``i0`` and ``i0 + 1``, issued (in flight)."""
        s0 = i0 % STAGES
        s1 = (i0 + 1) % STAGES
        mbarrier.wait(kv_ready.index(s0), (i0 // STAGES) & 1)
        mbarrier.wait(kv_ready.index(s1), ((i0 + 1) // STAGES) & 1)
        b0 = warpgroup_mma(q_c, k_smem.index(s0).permute((1, 0)), bias, is_async=True)
        b1 = warpgroup_mma(q_c, k_smem.index(s1).permute((1, 0)), bias, is_async=True)
        return b0, b1

    @gluon.jit
    def _paired_blocks(
        q_c, k_smem, v_smem, kv_ready, kv_empty, bias, acc, m_i, l_i, a_row, ks_ptr, k_group,
        first, n_pairs, p_layout: gl.constexpr,
        row_o: gl.constexpr, STAGES: gl.constexpr,
        BLOCK_N: gl.constexpr, PIPE: gl.constexpr, LAZY: gl.constexpr,
    ):  # fmt: skip
        """Unmasked key blocks ``[first, first + 2 n_pairs)`` (n_pairs >= 1) two at a time:
        one softmax update and one rescale of the accumulator a pair; with ``PIPE`` P·V of the
        previous pair runs under this pair's softmax."""
        if PIPE:
            b0, b1 = _pair_scores(q_c, k_smem, kv_ready, bias, first, STAGES)
            b0, b1 = warpgroup_mma_wait(num_outstanding=0, deps=(b0, b1))
            p0, p1, m_i, l_i, alpha = _softmax_pair(b0, b1, m_i, l_i, a_row, ks_ptr, k_group,
                                                    first * BLOCK_N,
                                                    BLOCK_N)  # fmt: skip
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            p80 = gl.convert_layout(p0.to(gl.float8e4nv), p_layout)
            p81 = gl.convert_layout(p1.to(gl.float8e4nv), p_layout)
            for j in range(1, n_pairs):
                i0 = first + 2 * j
                t0 = (i0 - 2) % STAGES
                t1 = (i0 - 1) % STAGES
                b0, b1 = _pair_scores(q_c, k_smem, kv_ready, bias, i0, STAGES)
                acc = warpgroup_mma(p80, v_smem.index(t0).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma(p81, v_smem.index(t1).permute((1, 0)), acc, is_async=True)
                b0, b1 = warpgroup_mma_wait(num_outstanding=2, deps=(b0, b1))
                p0, p1, m_i, l_i, alpha = _softmax_pair(b0, b1, m_i, l_i, a_row, ks_ptr,
                                                        k_group, i0 * BLOCK_N,
                                                        BLOCK_N)  # fmt: skip
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(t0), count=1)
                mbarrier.arrive(kv_empty.index(t1), count=1)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                p80 = gl.convert_layout(p0.to(gl.float8e4nv), p_layout)
                p81 = gl.convert_layout(p1.to(gl.float8e4nv), p_layout)
            t0 = (first + 2 * n_pairs - 2) % STAGES
            t1 = (first + 2 * n_pairs - 1) % STAGES
            acc = warpgroup_mma(p80, v_smem.index(t0).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(p81, v_smem.index(t1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            mbarrier.arrive(kv_empty.index(t0), count=1)
            mbarrier.arrive(kv_empty.index(t1), count=1)
        else:
            for j in range(n_pairs):
                i0 = first + 2 * j
                s0 = i0 % STAGES
                s1 = (i0 + 1) % STAGES
                b0, b1 = _pair_scores(q_c, k_smem, kv_ready, bias, i0, STAGES)
                b0, b1 = warpgroup_mma_wait(num_outstanding=0, deps=(b0, b1))
                n0 = i0 * BLOCK_N
                ab0 = a_row * _k_scale(ks_ptr, n0, k_group)
                ab1 = a_row * _k_scale(ks_ptr, n0 + BLOCK_N, k_group)
                m_new = gl.maximum(gl.maximum(m_i, _row_max(b0) * ab0), _row_max(b1) * ab1)
                acc, m_i, l_i = _rescale(acc, m_i, l_i, m_new, row_o, LAZY)
                p, l_add = _exp_block(b0, ab0, m_i)
                acc = warpgroup_mma(gl.convert_layout(p.to(gl.float8e4nv), p_layout),
                                    v_smem.index(s0).permute((1, 0)), acc,
                                    is_async=True)  # fmt: skip
                p, l1 = _exp_block(b1, ab1, m_i)
                acc = warpgroup_mma(gl.convert_layout(p.to(gl.float8e4nv), p_layout),
                                    v_smem.index(s1).permute((1, 0)), acc,
                                    is_async=True)  # fmt: skip
                l_i = l_i + (l_add + l1)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(kv_empty.index(s0), count=1)
                mbarrier.arrive(kv_empty.index(s1), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _quad_blocks(
        q_c, k_smem, v_smem, kv_ready, kv_empty, bias, acc, m_i, l_i, a_row, ks_ptr, k_group,
        n_quads, p_layout: gl.constexpr, row_o: gl.constexpr,
        STAGES: gl.constexpr,
        BLOCK_N: gl.constexpr, LAZY: gl.constexpr,
    ):  # fmt: skip
        """Unmasked key blocks ``[0, 4 n_quads)`` four at a time: one softmax update and one
        rescale of the accumulator for 256 keys."""
        for j in range(n_quads):
            i0 = 4 * j
            b0, b1 = _pair_scores(q_c, k_smem, kv_ready, bias, i0, STAGES)
            b2, b3 = _pair_scores(q_c, k_smem, kv_ready, bias, i0 + 2, STAGES)
            b0, b1, b2, b3 = warpgroup_mma_wait(num_outstanding=0, deps=(b0, b1, b2, b3))
            n0 = i0 * BLOCK_N
            ab0 = a_row * _k_scale(ks_ptr, n0, k_group)
            ab1 = a_row * _k_scale(ks_ptr, n0 + BLOCK_N, k_group)
            ab2 = a_row * _k_scale(ks_ptr, n0 + 2 * BLOCK_N, k_group)
            ab3 = a_row * _k_scale(ks_ptr, n0 + 3 * BLOCK_N, k_group)
            m_new = gl.maximum(
                gl.maximum(gl.maximum(m_i, _row_max(b0) * ab0), _row_max(b1) * ab1),
                gl.maximum(_row_max(b2) * ab2, _row_max(b3) * ab3),
            )
            acc, m_i, l_i = _rescale(acc, m_i, l_i, m_new, row_o, LAZY)
            p, l_add = _exp_block(b0, ab0, m_i)
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.float8e4nv), p_layout),
                                v_smem.index(i0 % STAGES).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            p, l1 = _exp_block(b1, ab1, m_i)
            l_add += l1
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.float8e4nv), p_layout),
                                v_smem.index((i0 + 1) % STAGES).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            p, l1 = _exp_block(b2, ab2, m_i)
            l_add += l1
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.float8e4nv), p_layout),
                                v_smem.index((i0 + 2) % STAGES).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            p, l1 = _exp_block(b3, ab3, m_i)
            l_add += l1
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.float8e4nv), p_layout),
                                v_smem.index((i0 + 3) % STAGES).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            l_i = l_i + l_add
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            for t in gl.static_range(4):
                mbarrier.arrive(kv_empty.index((i0 + t) % STAGES), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _rescale(acc, m_i, l_i, m_new, row_o: gl.constexpr, LAZY: gl.constexpr):
        """(acc, m, l) at the new row maxima. ``LAZY`` keeps the old maxima (and skips the
        accumulator's multiply) while no row of the warpgroup grew by more than
        ``LAZY_GROWTH``: P then stays below 2^(8 + LAZY_GROWTH) < 448, e4m3's largest."""
        if LAZY:
            if gl.max(m_new - m_i, 0) > LAZY_GROWTH:
                alpha = gl.exp2(m_i - m_new)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
                l_i = l_i * alpha
                m_i = m_new
        else:
            alpha = gl.exp2(m_i - m_new)
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            l_i = l_i * alpha
            m_i = m_new
        return acc, m_i, l_i

    @gluon.jit
    def _row_max(bits):
        """The largest score code of each row (the biased bits order as the floats)."""
        return gl.max(bits, 1).to(gl.float32, bitcast=True) - _BIAS

    @gluon.jit
    def _exp_block(bits, ab, m_new):
        """P (times 2^8) of one unmasked block at the row max ``m_new`` and its row sums."""
        c = 8.0 - m_new - _BIAS * ab
        p = gl.exp2(gl.fma(bits.to(gl.float32, bitcast=True), gl.expand_dims(ab, 1),
                           gl.expand_dims(c, 1)))  # fmt: skip
        return p, gl.sum(p, 1)

    @gluon.jit
    def _consumer_partition(
        q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty,
        q_scale_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr,
        b, h, hk, m0, S, HQ, HKV, used, hi_k, n_blocks, q_group, k_group, n_qg, n_kg, qk_scale,
        bias_bits, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, PIPE: gl.constexpr, UPDATE: gl.constexpr, LAZY: gl.constexpr,
        CONSUMER: gl.constexpr,
    ):  # fmt: skip
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 32]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 32]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)

        r0 = m0 + CONSUMER * BLOCK_M
        o_m = r0 + gl.arange(0, BLOCK_M, layout=row_s)
        o_n = gl.arange(0, BLOCK_N, layout=col_s)
        b_qs = gl.load(q_scale_ptr + (b * HQ + h) * n_qg + gl.minimum(o_m // q_group, n_qg - 1))
        a_row = b_qs * qk_scale  # [BM] log2 units
        ks_ptr = k_scale_ptr + (b * HKV + hk) * n_kg
        # this warpgroup's key blocks: [0, n_full) unmasked, [n_full, my_n) masked, the rest
        # of the program's blocks only released
        my_hi = hi_k
        if CAUSAL:
            my_hi = gl.minimum(hi_k, r0 + BLOCK_M)
        my_n = gl.where(r0 < used, (my_hi + BLOCK_N - 1) // BLOCK_N, 0)
        n_full = hi_k // BLOCK_N
        if CAUSAL:
            n_full = gl.minimum(r0 + 1, hi_k) // BLOCK_N
        n_full = gl.minimum(n_full, my_n)

        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
        # the bias arrives as an argument: a constant would be rematerialized in the loop and
        # tied to an accumulator, and ptxas then waits between the two score MMAs
        bias = gl.full([BLOCK_M, BLOCK_N], bias_bits, gl.int32, layout=s_layout)
        q_c = q_smem.slice(CONSUMER * BLOCK_M, BLOCK_M, dim=0)
        mbarrier.wait(q_bar, 0)

        first = 0
        if UPDATE == 4:
            n_quads = n_full // 4
            if n_quads > 0:
                acc, m_i, l_i = _quad_blocks(
                    q_c, k_smem, v_smem, kv_ready, kv_empty, bias, acc, m_i, l_i, a_row,
                    ks_ptr, k_group, n_quads, p_layout, row_o, STAGES, BLOCK_N,
                    LAZY,
                )  # fmt: skip
                first = 4 * n_quads
        if UPDATE >= 2:
            n_pairs = (n_full - first) // 2
            if n_pairs > 0:
                acc, m_i, l_i = _paired_blocks(
                    q_c, k_smem, v_smem, kv_ready, kv_empty, bias, acc, m_i, l_i, a_row,
                    ks_ptr, k_group, first, n_pairs, p_layout, row_o, STAGES,
                    BLOCK_N, PIPE, LAZY,
                )  # fmt: skip
                first += 2 * n_pairs
        elif PIPE:
            if n_full > 0:
                acc, m_i, l_i = _pipelined_blocks(
                    q_c, k_smem, v_smem, kv_ready, kv_empty, bias, acc, m_i, l_i, a_row,
                    ks_ptr, k_group, n_full, o_n, o_m, hi_k, p_layout, row_o,
                    STAGES, BLOCK_N, CAUSAL,
                )  # fmt: skip
                first = n_full
        for i in range(first, n_full):
            acc, m_i, l_i = _one_block(
                q_c, k_smem, v_smem, kv_ready, kv_empty, bias, acc, m_i, l_i, a_row, ks_ptr,
                k_group, i, o_n, o_m, hi_k, p_layout, row_o, STAGES, BLOCK_N,
                False, CAUSAL,
            )  # fmt: skip
        for i in range(n_full, my_n):  # the causal diagonal and the end of the keys
            acc, m_i, l_i = _one_block(
                q_c, k_smem, v_smem, kv_ready, kv_empty, bias, acc, m_i, l_i, a_row, ks_ptr,
                k_group, i, o_n, o_m, hi_k, p_layout, row_o, STAGES, BLOCK_N,
                True, CAUSAL,
            )  # fmt: skip
        for i in range(my_n, n_blocks):  # the other warpgroup's blocks: release only
            s = i % STAGES
            mbarrier.wait(kv_ready.index(s), (i // STAGES) & 1)
            mbarrier.arrive(kv_empty.index(s), count=1)

        # epilogue: 1 / l and the V scale once; rows past ``used`` are 0 with lse +inf
        o_mo = r0 + gl.arange(0, BLOCK_M, layout=row_o)
        o_d = gl.arange(0, D, layout=col_o)
        b_vs = gl.load(v_scale_ptr + (b * HKV + hk) * D + o_d)
        l_o = gl.convert_layout(l_i, row_o)
        live_o = o_mo < used
        inv = gl.where(live_o & (l_o > 0.0), 1.0 / l_o, 0.0)
        b_o = acc * gl.expand_dims(inv, 1) * gl.expand_dims(b_vs, 0)
        p_out = (out_ptr + ((b.to(gl.int64) * S + gl.expand_dims(o_mo, 1)) * HQ + h) * D
                 + gl.expand_dims(o_d, 0))  # fmt: skip
        gl.store(p_out, b_o.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(o_mo < S, 1))
        b_lse = (m_i + gl.log2(l_i) - 8.0) * LN2
        gl.store(lse_ptr + (b * HQ + h).to(gl.int64) * S + o_m,
                 gl.where(o_m < used, b_lse, float("inf")), mask=o_m < S)  # fmt: skip

    @gluon.jit
    def _codes_wgmma_kernel(
        desc_q, desc_k, desc_vt, q_scale_ptr, k_scale_ptr, v_scale_ptr, used_ptr, out_ptr, lse_ptr,
        S, HQ, HKV, q_group, qk_scale, bias_bits, k_group: gl.constexpr, D: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, HAS_USED: gl.constexpr, PIPE: gl.constexpr,
        UPDATE: gl.constexpr, LAZY: gl.constexpr,
    ):  # fmt: skip
        BLOCK_M: gl.constexpr = _BLOCK_M
        BLOCK_N: gl.constexpr = _BLOCK_N
        n_qg = (S + q_group - 1) // q_group  # Q and K scales a (batch, head)
        n_kg = (S + k_group - 1) // k_group
        i_m = gl.program_id(0)
        if CAUSAL:  # the longest rows first
            i_m = gl.num_programs(0) - 1 - i_m
        i_bh = gl.program_id(1)
        b = i_bh // HQ
        h = i_bh % HQ
        hk = h // (HQ // HKV)
        m0 = i_m * (2 * BLOCK_M)
        used = S
        if HAS_USED:
            used = gl.load(used_ptr + b)
        hi_k = used
        hi = hi_k
        if CAUSAL:
            hi = gl.minimum(hi_k, m0 + 2 * BLOCK_M)
        n_blocks = gl.where(m0 < used, (hi + BLOCK_N - 1) // BLOCK_N, 0)
        # the consumers' registers (the loader keeps what is left of the 64K)
        CONSUMER_REGS: gl.constexpr = 240 if UPDATE == 4 else 232

        q_smem = gl.allocate_shared_memory(gl.int8, [2 * BLOCK_M, D], desc_q.layout)
        k_smem = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, D], desc_k.layout)
        v_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, D, BLOCK_N], desc_vt.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(kv_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)

        q_row = b * S + m0
        k_row = b * S
        vt_row = (b * HKV + hk) * D
        gl.warp_specialize(
            [
                (_load_partition, (desc_q, desc_k, desc_vt, q_smem, k_smem, v_smem, q_bar,
                                   kv_ready, kv_empty, q_row, h * D, k_row, hk * D, vt_row,
                                   n_blocks, BLOCK_N, STAGES)),
                (_consumer_partition, (q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty,
                                       q_scale_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr,
                                       b, h, hk, m0, S, HQ, HKV, used, hi_k, n_blocks, q_group,
                                       k_group, n_qg, n_kg, qk_scale, bias_bits, D, BLOCK_M,
                                       BLOCK_N,
                                       STAGES, CAUSAL, PIPE, UPDATE, LAZY, 0)),
                (_consumer_partition, (q_smem, k_smem, v_smem, q_bar, kv_ready, kv_empty,
                                       q_scale_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr,
                                       b, h, hk, m0, S, HQ, HKV, used, hi_k, n_blocks, q_group,
                                       k_group, n_qg, n_kg, qk_scale, bias_bits, D, BLOCK_M,
                                       BLOCK_N,
                                       STAGES, CAUSAL, PIPE, UPDATE, LAZY, 1)),
            ],
            [4, 4],
            [CONSUMER_REGS, CONSUMER_REGS],
        )  # fmt: skip
