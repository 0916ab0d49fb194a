"""One exchange call's steps, one at a time, on the plan of that call (``ulysses.lowp``):
the local statistics launches, the post-gather launch on a given gathered table, the pack,
the scale gather. ``scripts/bench_lowp.py`` times each; tests run a P-rank exchange in one
process with them (each rank's steps, the collectives done by hand).
"""

from __future__ import annotations

import torch

from ulysses import stats
from ulysses.lowp import FP32, LowpQKV, _Call, _plan, _result


def local_stats(c: _Call) -> tuple:
    """The local statistics launch of ``c``'s plan: (payload, Q's partial amax, K's
    min/max), scratch buffers."""
    p = _plan(c.q, c.k, c.v, c.pg, c.used_sequence, c.q_group, c.k_group, None, c.v_format)[0]
    p.local_stats(c.k, c.q, c.v)
    return p.payload, p.amax_q, p.minmax


def finish_stats(c: _Call, gathered: torch.Tensor, amax_q, minmax) -> tuple:
    """The post-gather launch on ``gathered`` [P, n]: (SmoothKStats, Q's merged amax, V's
    amax, v_scale); the mean and v_scale are views of a new result buffer."""
    p = _plan(c.q, c.k, c.v, c.pg, c.used_sequence, c.q_group, c.k_group, None, c.v_format)[0]
    if gathered.data_ptr() != p.gathered.data_ptr():
        p.gathered.copy_(gathered)
    out = torch.empty_like(p.out_bytes)
    mean = out.view(p.dtype).as_strided(*p.mean_view)
    v_scale = out.view(FP32).as_strided(*p.v_scale_view)
    p.post(mean, p.part, p.final, v_scale)
    lay = c.part.layout
    k_stats = stats.SmoothKStats(mean, p.part, p.final, lay.rank, lay.P, lay.used, lay.G)
    return k_stats, p.amax_q, p.amax_v, v_scale


def pack(c: _Call, k_stats, amax_q, amax_v) -> torch.Tensor:
    """The pack launch: the uint8 send buffer [P * L * row_bytes] (new at P = 1)."""
    p = _plan(c.q, c.k, c.v, c.pg, c.used_sequence, c.q_group, c.k_group, None, c.v_format)[0]
    args = (c.q, c.k, c.v, amax_q, k_stats.amax_final, k_stats.k_mean_global, amax_v)
    if p.a2a is not None:
        p.pack(*args)
        return p.send
    recv = torch.empty_like(p.recv_out)
    p.pack(*args, recv)
    return recv


def unpack(c: _Call, recv: torch.Tensor, k_stats, v_scale: torch.Tensor) -> LowpQKV:
    """The scale gather, then the LowpQKV of the call (``v_scale`` a view of the result
    buffer :func:`finish_stats` made)."""
    p = _plan(c.q, c.k, c.v, c.pg, c.used_sequence, c.q_group, c.k_group, None, c.v_format)[0]
    out = v_scale._base
    p.gather_scales(recv.view(FP32), out.view(FP32))
    return _result(p.out, recv, out, p.dtype, p.fields)
