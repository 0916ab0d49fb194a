"""Attention backward on the exchange's 8-bit codes (docs/CONTRACT.md §14, §17).

Shape legend as in :mod:`.codes_attention`: B batch, S global rows, hq query heads and hkv
key/value heads (query head j reads key/value head ``j // G``, ``G = hq // hkv``), D head dim,
Gq / Gk the Q / K group sizes, S_pad = S rounded up to 128.

    dout, out   [B, S, hq, D] bf16/fp16     lse [B, hq, S] fp32 (natural log, +inf: dead row)
    q           [B, S, hq, D]  int8,  q_scale [B, hq, ceil(S / Gq)] fp32
    k           [B, S, hkv, D] int8,  k_scale [B, hkv, ceil(S / Gk)] fp32 (K centred)
    v           [B, S, hkv, D] e4m3 or int8, v_scale [B, hkv, D] fp32
    -> dq [B, S, hq, D], dk, dv [B, S, hkv, D] in dout's dtype

The gradients of attention over the dequantized values ``q_i = qc_i qs_i``, ``k_j = kc_j ks_j``,
``v_j = vc_j * vs`` (what ``ulysses.codes.blockwise_backward`` computes on them in fp32), from
the forward's ``out`` and ``lse`` without a second forward. Per query row i and key j (over the
keys row i attends: ``j < used``, ``j <= i`` when causal, the same document):

    p_ij  = exp(s_ij - lse_i),  s_ij = (qc_i . kc_j) qs_i ks_j sm        (int32 dot, exact)
    dv_j  = sum_i p_ij dO_i
    dP_ij = dO_i . v_j,  delta_i = dO_i . O_i,  dS_ij = p_ij (dP_ij - delta_i)
    dq_i  = sm sum_j dS_ij k_j,  dk_j = sm sum_i dS_ij q_i

Rows at or past ``used`` get 0 gradients.

How each product runs (:class:`BackwardConfig` picks; the default runs dV in FP8 and dQ/dK
with 16-bit dS, see ``GPU_DEFAULT``):

* scores: INT8 ``qc . kc`` in int32 (exact), converted by adding the bits of ``1.5 * 2^23``
  and subtracting it as a float (two full-rate operations), scaled in fp32; ``p`` is computed times
  ``2^8`` (e4m3's range, folded into the exponent), the factor removed at the end.
* ``dV = P^T dO`` in FP8: ``e4m3(2^8 p)`` times ``e4m3(dO c)``, ``c = 448 / amax`` one scale a
  (batch row, K/V head) over the live rows of its query heads (e4m3 is a floating format: a
  finer, per-block scale would only move the underflow threshold, which ``c`` already puts
  2^15 below the largest element); fp32 accumulation.
* ``dP = dO V^T`` in 16 bits: ``bf16(dO * vs)`` (one rounding) times the V codes in bf16
  (exact for e4m3 and int8 codes); fp32 accumulation.
* ``dQ = dS K`` and ``dK = dS^T Q``: with ``ds_int8``, in INT8: ``dS`` times the other side's
  row scale (``ks_j`` for dQ, ``qs_i`` for dK) is quantized per row of the tile (a query row
  of a key block for dQ, a key row of a query block for dK) to ``rne(x * 127 / amax_row)``,
  multiplied with the K or Q codes exactly in int32, and added to an fp32 accumulator times
  ``amax_row / 127``. The 8-bit operands are read K-major (Hopper's 8-bit
  MMAs read B that way): transposed copies of the Q and K codes and of dO's e4m3 codes, made
  once a call. Without it (the default), ``dS`` (times the row scale) rounded to bf16 times
  the codes in bf16 (exact), fp32 accumulation.

Error bound against fp32 gradients of the dequantized values (all quantities in exact
arithmetic on the dequantized values; ``|x|`` elementwise; ``u`` = 2^-8; ``O`` the ``out``
given, ``O*`` the exact output). e4m3 rounds ``x`` to within ``2^-4 |x| + 2^-10`` (normal:
relative 2^-4; subnormal: half its step 2^-9); bf16 to within ``2^-9 |x|`` (2^-8 in Triton's
interpreter, which truncates); rne to an int8 code within 1/2.

* ``p``: fp32 exp2 of an argument of fp32 roundings: ``|p^ - p| <= eps_p p``, ``eps_p``
  ~ 2^-20 |s|, negligible (taken as 2^-16).
* ``dV``: ``e4m3(2^8 p) / 2^8 = p (1 + a) + b`` with ``|a| <= 2^-4``, ``|b| <= 2^-18``;
  ``e4m3(dO c) / c = dO (1 + a') + b'`` with ``|a'| <= 2^-4``, ``|b'| <= 2^-10 / c``. So

      |dV^ - dV|_jd <= (2^-3 + 2^-7) (P^T |dO|)_jd + 2^-17 (A^T |dO|)_jd
                       + 2^-9 / c * ((P^T 1)_j + 2^-18 n_j) + u |dV|_jd

  with ``A`` the 0/1 matrix of attended pairs, ``n_j`` the rows that attend key j, and the
  last term the output's rounding to 16 bits.
* ``dP``: ``|dP^ - dP|_ij <= u M_ij``, ``M = |dO| |V|^T`` (bf16 rounding of ``dO * vs``);
  ``delta``: ``|delta^ - delta|_i <= E_i = (|dO| |O - O*|)_i + 2^-16 (|dO| |O|)_i`` (the
  second term: fp32 summation over D <= 256 channels).
* ``dS``: ``|dS^ - dS|_ij <= p_ij (u M_ij + E_i) + eps_p |dS_ij| =: F_ij``.
* ``dQ`` (INT8 dS): the code of ``dS^_ij ks_j`` is off by at most ``R_i / 254`` with ``R_i``
  the row's largest ``|dS^_ij ks_j|`` over its key block, at most over all keys:

      |dQ^ - dQ|_id <= sm (F |K|)_id + sm (R_i + max_j F_ij ks_j) / 254 * (A |Kc|)_id + u |dQ|_id

  (``Kc`` the K codes); with 16-bit dS the middle term is ``sm 2^-8 (|dS| |K|)_id``.
* ``dK``: the same with the roles of rows and keys swapped: ``sm (F^T |Q|)_jd + sm (R'_j +
  max_i F_ij qs_i) / 254 * (A^T |Qc|)_jd + u |dK|_jd``, ``R'_j = max_i |dS_ij qs_i|``.

:func:`backward_error_bound` evaluates these from fp64 reference quantities (the tests assert
them; ``scripts/bench_codes_backward.py`` reports the error against them).

Grids: dK/dV one program per (key block, batch row, K/V head), looping over the G query heads
of the group and their query blocks (deterministic: no atomics), by default two launches (dV,
then dK, each recomputing the scores); dQ a second kernel, one
program per (query block, batch row, query head) looping over key blocks; causal launches the
longest rows first. A small pre-pass computes ``delta``, ``bf16(dO * vs)``, dO's e4m3 codes
(transposed) and the padded per-row scale and log-sum-exp vectors.
"""

from __future__ import annotations

import torch

from ._runtime import cdiv, compiled_for_gpu, launch
from ._scratch import device_constant
from .codes_backward_bound import backward_error_bound
from .codes_backward_jit import (
    BWD,
    LOG2E,
    _bwd_amax_kernel,
    _bwd_dkdv_kernel,
    _bwd_dq_kernel,
    _bwd_pre_kernel,
)

__all__ = [
    "BackwardConfig",
    "GPU_DEFAULT",
    "backward_error_bound",
    "codes_attention_backward",
]


class BackwardConfig(tuple):
    """(dkdv BLOCK_M, BLOCK_N, warps, stages, dq BLOCK_M, BLOCK_N, warps, stages, dv_fp8,
    ds_int8, v_copy, kv_split): one launch configuration. ``dv_fp8``: dV = P^T dO in e4m3 (else bf16 P
    and the 16-bit dO); ``ds_int8``: dQ and dK with INT8 dS (else bf16 dS times the codes in
    bf16); ``v_copy``: dP reads a bf16 copy of the V codes made once a call (else the codes,
    converted in registers); ``kv_split``: dV and dK by two launches of the key-block kernel
    (each recomputes the scores and P; one accumulator a program) rather than one (both
    accumulators: at D 128 more registers than a thread has). Every choice computes the same
    values but for the 8-bit roundings."""

    __slots__ = ()

    def __new__(cls, kv_m=32, kv_n=128, kv_warps=8, kv_stages=2, q_m=64, q_n=64, q_warps=8,
                q_stages=2, dv_fp8=True, ds_int8=False, v_copy=True, kv_split=True):  # fmt: skip
        return super().__new__(cls, (kv_m, kv_n, kv_warps, kv_stages, q_m, q_n, q_warps, q_stages,
                                     bool(dv_fp8), bool(ds_int8), bool(v_copy), bool(kv_split)))  # fmt: skip

    def __getnewargs__(self):
        return tuple(self)

    kv_m = property(lambda self: self[0])
    kv_n = property(lambda self: self[1])
    kv_warps = property(lambda self: self[2])
    kv_stages = property(lambda self: self[3])
    q_m = property(lambda self: self[4])
    q_n = property(lambda self: self[5])
    q_warps = property(lambda self: self[6])
    q_stages = property(lambda self: self[7])
    dv_fp8 = property(lambda self: self[8])
    ds_int8 = property(lambda self: self[9])
    v_copy = property(lambda self: self[10])
    kv_split = property(lambda self: self[11])

    def replace(self, **kw) -> BackwardConfig:
        names = ("kv_m", "kv_n", "kv_warps", "kv_stages", "q_m", "q_n", "q_warps", "q_stages",
                 "dv_fp8", "ds_int8", "v_copy", "kv_split")  # fmt: skip
        return BackwardConfig(*(kw.get(n, getattr(self, n)) for n in names))

    def __repr__(self) -> str:
        bits = ("v8" if self[8] else "v16") + ("-s8" if self[9] else "-s16")
        bits += ("" if self[10] else "-vcodes") + ("" if self[11] else "-kvjoint")
        return (f"kv{self[0]}x{self[1]}w{self[2]}s{self[3]}-q{self[4]}x{self[5]}w{self[6]}"
                f"s{self[7]}-{bits}")  # fmt: skip


# On CUDA: tiles whose kernels compile for sm_90 with Triton 3.6 with little register spill
# at D 128 (ptxas through tools/compile_sm90.py: at most 40 bytes a thread at full
# attention, 200 in the causal dV kernel, whose masked blocks hold more), FP8 dV, 16-bit dS
# (with INT8 dS the dK kernel spills 340-380 bytes a thread, the dQ kernel 40-150), dV and
# dK in two launches (one accumulator a program; both in one program spill 1.5-1.9 KB a
# thread). Not yet timed on a GPU: scripts/bench_codes_backward.py --sweep compares them.
# On CPU (the interpreter): small one-warp tiles, the same products.
GPU_DEFAULT = BackwardConfig()
_CPU_CONFIG = BackwardConfig(32, 32, 1, 1, 32, 32, 1, 1)
_PAD = 128  # S_pad: S rounded up to this (a multiple of every block size)
# the grid tables on their devices, one a signature: made through pinned memory, so that a
# first call inside a CUDA-graph capture may make one, and kept (never emptied by
# clear_caches: a captured graph may read one)
_TABLES: dict[tuple, torch.Tensor] = {}


def _transposed_codes(x: torch.Tensor, S_pad: int) -> torch.Tensor:
    """int8 codes [B, S, h, D] -> [B, h, D, S_pad] (zeros past S): the K-major operand of an
    8-bit product that reduces over rows."""
    B, S, h, D = x.shape
    out = torch.zeros((B, h, D, S_pad), dtype=x.dtype, device=x.device)
    out[..., :S] = x.permute(0, 2, 3, 1)
    return out


def codes_attention_backward(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    q_group: int,
    k_group: int,
    causal: bool = False,
    sm_scale: float | None = None,
    used: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    config: BackwardConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq [B, S, hq, D], dk [B, S, hkv, D], dv [B, S, hkv, D])`` in ``dout``'s dtype: the
    gradients of attention over the dequantized codes (module docstring) from the forward's
    ``out`` and ``lse`` (as ``codes_attention`` writes them). The codes and scales are taken
    as ``codes_attention`` takes them (strided views of the receive buffer are fine);
    ``used``: None or int32 [B] live rows; ``doc_ids``: None or integer [B, S], non-decreasing.
    ``config``: a :class:`BackwardConfig` (default: ``GPU_DEFAULT`` on CUDA, small tiles on
    the interpreter). Launcher: invariants are asserted, the layer validates user input."""
    B, S, HQ, D = q.shape
    HKV = k.shape[2]
    assert q.dtype == torch.int8 and k.dtype == torch.int8
    assert v.dtype in (torch.float8_e4m3fn, torch.int8)
    assert k.shape == v.shape == (B, S, HKV, D) and HKV >= 1 and HQ % HKV == 0
    assert dout.shape == out.shape == (B, S, HQ, D) and dout.dtype in (torch.bfloat16,
                                                                        torch.float16)  # fmt: skip
    assert lse.shape == (B, HQ, S) and lse.dtype == torch.float32
    assert q.stride(3) == k.stride(3) == v.stride(3) == dout.stride(3) == out.stride(3) == 1
    assert q_scale.shape == (B, HQ, cdiv(S, q_group)), q_scale.shape
    assert k_scale.shape == (B, HKV, cdiv(S, k_group)), k_scale.shape
    assert v_scale.shape == (B, HKV, D)
    assert D in (32, 64, 128, 256)
    device = q.device
    gpu = compiled_for_gpu(device)
    cfg = config or (GPU_DEFAULT if gpu else _CPU_CONFIG)
    sm = D**-0.5 if sm_scale is None else float(sm_scale)
    dq = torch.empty((B, S, HQ, D), dtype=dout.dtype, device=device)
    dk = torch.empty((B, S, HKV, D), dtype=dout.dtype, device=device)
    dv = torch.empty((B, S, HKV, D), dtype=dout.dtype, device=device)
    if dq.numel() == 0:
        return dq, dk, dv
    if used is not None:
        assert used.shape == (B,) and used.device == device
        used = used.to(torch.int32).contiguous()
    bounds = None
    if doc_ids is not None:
        from .codes_attention import document_bounds

        assert doc_ids.shape == (B, S) and doc_ids.device == device
        doc_ids = doc_ids.to(torch.int32).contiguous()
        bounds = document_bounds(doc_ids)
    S_pad = cdiv(S, _PAD) * _PAD
    # per-row scales, padded: qa = q_scale * sm * log2(e) [B*hq, S_pad], kr = k_scale [B*hkv]
    # per-row vectors, padded, in one fp32 buffer: qa = q_scale * sm * log2(e) [B*hq, S_pad],
    # lse * log2(e), delta (both written by the pre-pass), kr = k_scale [B*hkv, S_pad]
    n_rows = B * HQ * S_pad
    rows = torch.empty((3 * n_rows + B * HKV * S_pad,), dtype=torch.float32, device=device)
    qa = q_scale.float().repeat_interleave(q_group, -1)[..., :S] * (sm * LOG2E)
    rows[:n_rows].view(B, HQ, S_pad).copy_(torch.nn.functional.pad(qa, (0, S_pad - S)))
    kr = k_scale.float().repeat_interleave(k_group, -1)[..., :S]
    rows[3 * n_rows :].view(B, HKV, S_pad).copy_(torch.nn.functional.pad(kr, (0, S_pad - S)))
    lse2, delta = rows[n_rows : 2 * n_rows], rows[2 * n_rows : 3 * n_rows]
    # live counts, document ids and bounds in one int32 buffer
    ints = torch.zeros((B + 3 * B * S,), dtype=torch.int32, device=device)
    if used is not None:
        ints[:B] = used
    if doc_ids is not None:
        ints[B : B + B * S] = doc_ids.reshape(-1)
        ints[B + B * S :] = bounds.reshape(-1)
    v_scale = v_scale.float().contiguous()
    dos = torch.empty((B * HQ, S_pad, D), dtype=torch.bfloat16, device=device)
    amax = torch.zeros((B * HKV,), dtype=torch.int32, device=device)
    do8t = torch.empty((B * HQ, D, S_pad) if cfg.dv_fp8 else (1,), dtype=torch.uint8,
                       device=device)  # fmt: skip
    qt = _transposed_codes(q, S_pad) if cfg.ds_int8 else q
    kt = _transposed_codes(k, S_pad) if cfg.ds_int8 else k
    if cfg.v_copy:  # the V codes in bf16 (exact): a 16-bit operand read as it lies
        vb = torch.empty((B, HKV, S, D), dtype=torch.bfloat16, device=device)
        vb.copy_(v.permute(0, 2, 1, 3))
        vb, v_mode = vb.permute(0, 2, 1, 3), 2
    else:
        vb, v_mode = v, int(v.dtype == torch.int8)
    dstr = (dout.stride(0), dout.stride(1), dout.stride(2))
    values = BWD.pack(dict(
        stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2), stride_kb=k.stride(0),
        stride_ks=k.stride(1), stride_kh=k.stride(2), stride_vb=vb.stride(0),
        stride_vs=vb.stride(1), stride_vh=vb.stride(2), stride_db=dstr[0], stride_ds=dstr[1],
        stride_dh=dstr[2], S=S, S_pad=S_pad, HQ=HQ, HKV=HKV, B=B,
    ))  # fmt: skip
    assert all(0 <= x < 2**31 for x in values), values
    tab = _TABLES.get((tuple(values), device))
    if tab is None:
        tab = _TABLES[(tuple(values), device)] = device_constant(
            torch.tensor(values, dtype=torch.int32), device
        )
    hints = sum(1 << i for i, x in enumerate(values[:12]) if x % 16 == 0)
    flags = (bool(causal) | (used is not None) << 1 | (doc_ids is not None) << 2
             | cfg.dv_fp8 << 3 | cfg.ds_int8 << 4 | gpu << 5 | v_mode << 6)  # fmt: skip
    pre_block = 64 if gpu else 128
    if cfg.dv_fp8:
        launch(
            _bwd_amax_kernel, (cdiv(S, pre_block), B * HQ), device, num_warps=4 if gpu else 1,
            dout_ptr=dout, stride_db=dstr[0], stride_ds=dstr[1], stride_dh=dstr[2],
            used_ptr=ints, amax_ptr=amax, S=S, S_pad=S_pad, HQ=HQ, HKV=HKV, D=D,
            BLOCK=pre_block, HAS_USED=used is not None,
        )  # fmt: skip
    launch(
        _bwd_pre_kernel, (S_pad // pre_block, B * HQ), device, num_warps=4 if gpu else 1,
        dout_ptr=dout, stride_db=dstr[0], stride_ds=dstr[1], stride_dh=dstr[2],
        out_ptr=out, stride_ob=out.stride(0), stride_os=out.stride(1), stride_oh=out.stride(2),
        lse_ptr=lse.contiguous(), v_scale_ptr=v_scale, used_ptr=ints, amax_ptr=amax,
        delta_ptr=delta, lse2_ptr=lse2, dos_ptr=dos, do8t_ptr=do8t, S=S, S_pad=S_pad, HQ=HQ,
        HKV=HKV, D=D, BLOCK=pre_block, HAS_USED=used is not None, DV_FP8=cfg.dv_fp8,
        HW_ROUND=gpu,
    )  # fmt: skip
    for part in (1, 2) if cfg.kv_split else (0,):  # dV and dK apart, or together
        launch(
            _bwd_dkdv_kernel, (cdiv(S, cfg.kv_n), B * HKV), device, num_warps=cfg.kv_warps,
            q_ptr=q, k_ptr=k, v_ptr=vb, dout_ptr=dout, rows_ptr=rows, dos_ptr=dos,
            do8t_ptr=do8t.view(torch.float8_e4m3fn), qt_ptr=qt, amax_ptr=amax, ints_ptr=ints,
            dk_ptr=dk, dv_ptr=dv, tab_ptr=tab, D=D, BLOCK_M=cfg.kv_m, BLOCK_N=cfg.kv_n,
            NUM_STAGES=cfg.kv_stages, FLAGS=flags | part << 8, HINTS=hints,
        )  # fmt: skip
    launch(
        _bwd_dq_kernel, (cdiv(S, cfg.q_m), B * HQ), device, num_warps=cfg.q_warps,
        q_ptr=q, k_ptr=k, v_ptr=vb, rows_ptr=rows, dos_ptr=dos, kt_ptr=kt, ints_ptr=ints,
        dq_ptr=dq, tab_ptr=tab, sm_scale=sm, D=D, BLOCK_M=cfg.q_m, BLOCK_N=cfg.q_n,
        NUM_STAGES=cfg.q_stages, FLAGS=flags, HINTS=hints,
    )  # fmt: skip
    return dq, dk, dv
