"""The exchange's plan: one call signature of :func:`ulysses.lowp.exchange_qkv` prepared once
(its launches bound to scratch buffers of one device and stream, its collectives bound to
them), and the cache of plans by call signature. Shape legend: ``ulysses.lowp``.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from .. import _hooks, comm, grid, mesh, stats
from .._plans import PlanCache
from ..kernels._launch import View
from ..kernels._runtime import output_template, stream_key, workspace
from ..kernels.block_stats import k_stats_part
from ..kernels.finalize_stats import MODE_FUSED, finalize_part
from ..kernels.lowp_dequant import prepare_dequant
from ..kernels.lowp_finish import lowp_finish_part, prepare_post_gather
from ..kernels.lowp_pack import QOnce, prepare_pack
from ..kernels.lowp_qv_stats import qv_payload_numel, qv_stats_part
from ..kernels.lowp_scales import prepare_gather_scales
from ..kernels.lowp_stats import prepare_lowp_stats
from .prepare import _Call, _prepare
from .result import LowpQKV, _result
from .wire import (
    _V_CODES,
    _V_MAX,
    FP32,
    _Out,
    _out_layout,
    _scale_index,
    _Wire,
    _wire,
    _wire_heads,
)


@dataclasses.dataclass(frozen=True)
class _SendConfig:
    """What the send side of a plan's head chunks is built from (no tensor of a call)."""

    shape: tuple  # q's [B, L, Hq, D]
    strides: tuple  # q's, k's, v's
    device: torch.device
    P: int
    rank: int
    Hkv: int
    q_group: int
    k_group: int
    n_sq: int
    n_sk: int
    use_pdl: bool
    q_once: QOnce | None
    dtype: torch.dtype
    pack_tiles: dict
    v_format: str = "fp8"


@dataclasses.dataclass(frozen=True)
class _Side:
    """The send side of head chunk ``chunk`` of ``n``: its wire (``h/n`` query and ``hkv/n``
    K/V heads a rank), where its results lie, the pack launch (all heads' statistics in, this
    chunk's heads out), the scale gather (``exchange_qkv``) and the dequantize, which reads
    Q's and K's group scales from the receive buffer through the gather's index and v_scale
    from the call's result bytes (``dequant_at``: views fixed here, buffers
    ``(recv, out, q_out, k_out, v_out)``)."""

    chunk: int
    n: int
    wire: _Wire
    out: _Out
    pack: object
    gather_scales: object
    dequant: object
    recv_out: torch.Tensor
    heads_q: torch.Tensor
    heads_kv: torch.Tensor
    dequant_at: object
    # the chunk's v_scale (fp32 words) and K mean (input dtype) as (size, stride, offset)
    # views of the call's result bytes (all heads' statistics)
    v_scale_at: tuple
    k_mean_at: tuple

    def codes(self, recv: torch.Tensor, whole_out: torch.Tensor, dtype, fields: tuple,
              v_code) -> LowpQKV:  # fmt: skip
        """The chunk's :class:`LowpQKV` from its receive buffer and the call's result bytes:
        codes as views of ``recv``, Q's and K's group scales gathered (one launch) into new
        bytes, v_scale and k_mean views of ``whole_out``. ``fields``: (used_sequence,
        q_group, k_group)."""
        o = self.out
        words = torch.empty(o.n_index, dtype=FP32, device=recv.device)
        self.gather_scales(recv.view(torch.int32), words.view(torch.int32))
        codes = recv.view(torch.int8)
        return LowpQKV(
            codes.as_strided(o.size_q, o.stride, o.offsets[0]),
            codes.as_strided(o.size_kv, o.stride, o.offsets[1]),
            recv.view(v_code).as_strided(o.size_kv, o.stride, o.offsets[2]),
            words.as_strided(*o.q_scale), words.as_strided(*o.k_scale),
            whole_out.view(FP32).as_strided(*self.v_scale_at),
            whole_out.view(dtype).as_strided(*self.k_mean_at), *fields,
        )  # fmt: skip


def _send_side(
    s: _SendConfig, chunk: tuple[int, int], send: torch.Tensor | None, kv_once: bool = False
) -> _Side:
    """The send side of head chunk ``chunk = (c, n)`` (``(0, 1)``: the whole exchange) bound to
    ``send`` (None: the call passes a send buffer). The one builder of the pack, the scale
    gather and the dequantize launches. ``kv_once``: the rank's K/V heads all with chunk 0,
    none with the others (:func:`ulysses.lowp.exchange_heads`)."""
    c, n = chunk
    B, L, Hq, D = s.shape
    dev, P = s.device, s.P
    if kv_once:
        whole = _wire(B, L, Hq, D, P, s.q_group, s.k_group, s.Hkv)
        hkv = whole.hkv if c == 0 else 0
        w = _wire_heads(B, L, whole.h // n, hkv, whole.kv_rep, D, P, s.q_group, s.k_group)
        k_first = 0  # the chunk's first K/V head of those a rank receives
    else:
        w = _wire(B, L, Hq // n, D, P, s.q_group, s.k_group, s.Hkv // n)
        k_first = c * w.hkv
    block_d = _hooks.active.pack_channel_block  # None but for a planted fault
    pack = prepare_pack(
        s.shape, s.strides, dev, send, world_size=P, row0=s.rank * L, q_group=s.q_group,
        k_group=s.k_group, n_sq=s.n_sq, n_sk=s.n_sk, row_bytes=w.row_bytes,
        scale_bytes=w.scale_bytes, use_pdl=s.use_pdl, kv_heads=s.Hkv, q_once=s.q_once,
        chunk=chunk, kv_once=kv_once, v_int8=s.v_format == "int8",
        block_d=block_d and block_d(D), **s.pack_tiles,
    )  # fmt: skip
    o = _out_layout(w, B, s.Hkv // n, D, s.dtype.itemsize, s.q_group, s.k_group, s.rank)
    index = _scale_index(w, B, s.q_group, s.k_group, dev)
    gather = prepare_gather_scales(index, dev)
    # the chunk's v_scale: its K/V heads of the call's v_scale [B, hkv, D] (the result bytes of
    # all heads' statistics)
    whole = o
    if n > 1:
        whole = _out_layout(_wire(B, L, Hq, D, P, s.q_group, s.k_group, s.Hkv), B, s.Hkv, D,
                            s.dtype.itemsize, s.q_group, s.k_group, s.rank)  # fmt: skip
    _, vs_stride, vs_at = whole.v_scale
    n_q, n_k = math.prod(o.q_scale[0]), math.prod(o.k_scale[0])
    dequant = prepare_dequant(
        o.size_q, o.size_kv, (o.stride,) * 3, dev, q_group=s.q_group, k_group=s.k_group,
        dtype=s.dtype, v_int8=s.v_format == "int8", v_scale_stride=vs_stride[0],
        scale_index=(index[:n_q], index[o.n_index - n_k :]),
    )  # fmt: skip
    recv_words = View("recv", FP32, (w.nbytes // 4,), (1,), 0)
    dequant_at = dequant.bind(
        ("recv", "out", "q_out", "k_out", "v_out"),
        q_ptr=View("recv", torch.int8, o.size_q, o.stride, o.offsets[0]),
        k_ptr=View("recv", torch.int8, o.size_kv, o.stride, o.offsets[1]),
        v_ptr=View("recv", _V_CODES[s.v_format], o.size_kv, o.stride, o.offsets[2]),
        q_scale_ptr=recv_words,  # Q's and K's scales where they arrived (the gather's index)
        k_scale_ptr=recv_words,
        v_scale_ptr=View("out", FP32, o.v_scale[0], vs_stride, vs_at + k_first * D),
        q_out_ptr="q_out", k_out_ptr="k_out", v_out_ptr="v_out",
    )  # fmt: skip
    return _Side(
        chunk=c, n=n, wire=w, out=o, pack=pack, gather_scales=gather, dequant=dequant,
        recv_out=output_template((w.nbytes,), torch.uint8, dev),
        heads_q=output_template(o.size_q, s.dtype, dev),
        heads_kv=output_template(o.size_kv, s.dtype, dev), dequant_at=dequant_at,
        v_scale_at=(o.v_scale[0], vs_stride, vs_at + k_first * D),
        k_mean_at=(o.v_scale[0], whole.k_mean[1], whole.k_mean[2] + k_first * D),
    )  # fmt: skip


class _ExchangePlan:
    """One call signature of :func:`exchange_qkv`, prepared once: the statistics, post-gather,
    pack and scale-gather launches bound to scratch buffers of this device and stream
    (payload, gathered, K's min/max, Q's partial amax, K's group amax, the send buffer) and
    the collectives bound to them. Every path runs it: eager calls directly, compiled calls
    (and tensor subclasses) through the op ``lowp_exchange``. A call allocates the receive
    buffer and the result bytes (:class:`_Out`; a call of ``exchange_to_heads``, which reads
    them itself, uses scratch ones and allocates only its outputs); at world size 1 there is
    no collective: the finalize reads the payload and the pack writes the receive buffer
    itself."""

    def __init__(self, c: _Call, tiles: dict | None = None):
        # ``tiles`` (benchmarks only): {"q_once": bool, "qv": {...}, "pack": {...}}, launch
        # settings that override the defaults; every choice gives the same bits
        tiles = tiles or {}
        q, k, v = c.q, c.k, c.v
        B, L, Hkv, D = k.shape
        Hq = q.shape[2]
        dev, P, part, w = k.device, c.P, c.part, c.wire
        lay_k, lay_q = part.layout, c.lay_q
        n_k, n = part.numel, part.numel + qv_payload_numel(B, Hq, D, Hkv)
        self.payload = payload = workspace("lowp_payload", n, FP32, dev)[:n]
        if P == 1:  # the payload is the gathered table
            self.gather = None
            self.gathered = payload.view(1, n)
        else:
            gathered = workspace("lowp_gathered", P * n, FP32, dev)[: P * n]
            self.gather = comm.all_gather_launcher(gathered, payload)
            self.gathered = gathered.view(P, n)
        n_mm = B * lay_k.n_slots * 2 * Hkv * D
        self.minmax = workspace("lowp_minmax", n_mm, k.dtype, dev)[:n_mm]
        self.minmax = self.minmax.view(B, lay_k.n_slots, 2, Hkv, D)
        # Q read once, by the pack kernel, where its group tile fits in registers; then the
        # statistics kernel reads Q only for the first and last touched slot
        q_once = None
        if tiles.get("q_once", True) and c.q_once:
            q_once = QOnce(
                lay_q.n_touched, lay_q.tail_group, lay_q.live_end, lay_q.floor, lay_q.per_row
            )
        n_q = B * Hq * lay_q.n_slots
        self.amax_q = workspace("lowp_amax_q", n_q, FP32, dev)[:n_q].view(B, Hq, lay_q.n_slots)
        # K's, Q's and V's statistics: ONE launch (kernels/lowp_stats), writing the payload
        # [K's | Q's boundary slots, V's amax]
        k_part = k_stats_part(
            k.shape, k.stride(), dev, payload[:n_k], self.minmax, minmax_mode=part.minmax_mode,
            tag=part.tag, use_pdl=c.use_pdl, **lay_k.stats_args(),
        )  # fmt: skip
        qv_part = qv_stats_part(
            q.shape, q.stride(), v.stride(), dev, payload, self.amax_q, group_size=c.q_group,
            row0=lay_q.row0, n_slots=lay_q.n_slots, n_touched=lay_q.n_touched,
            tail_group=lay_q.tail_group, live_end=lay_q.live_end, floor=lay_q.floor,
            use_pdl=c.use_pdl, q_boundary_only=q_once is not None, v_heads=Hkv,
            per_row=lay_q.per_row, payload_at=n_k, counters_at=k_part.counters,
            **tiles.get("qv", {}),
        )  # fmt: skip
        self.local_stats = prepare_lowp_stats(k_part, qv_part, dev)
        # K's finalize, Q's boundary merge, V's amax over ranks and v_scale: ONE launch
        # (prepare_post_gather of kernels/lowp_finish)
        n_v = B * Hkv * D
        self.amax_v = workspace("lowp_amax_v", n_v, FP32, dev)[:n_v].view(B, Hkv, D)
        finish = lowp_finish_part(
            self.gathered, self.amax_q, self.amax_v, first_sources=lay_q.first_sources,
            last_sources=lay_q.last_sources, n_touched=lay_q.n_touched, q_off=n_k,
            v_off=n_k + 2 * B * Hq, rank=c.rank, world_size=P, kv_rep=w.kv_rep,
            v_max=(_hooks.active.v_max or _V_MAX)[c.v_format],
        )  # fmt: skip
        k_finalize = finalize_part(
            self.gathered[:, :n_k], self.minmax, mode=MODE_FUSED, **part.finalize_args()
        )
        self.post = prepare_post_gather(k_finalize, finish)
        self.P = P
        # what the send side of any head chunk needs (scalars only: no tensor of the call)
        self.send_config = _SendConfig(
            shape=tuple(q.shape), strides=(q.stride(), k.stride(), v.stride()), device=dev,
            P=P, rank=c.rank, Hkv=Hkv, q_group=c.q_group, k_group=c.k_group,
            n_sq=lay_q.n_slots, n_sk=lay_k.n_slots, use_pdl=c.use_pdl, q_once=q_once,
            dtype=k.dtype, pack_tiles=tiles.get("pack", {}), v_format=c.v_format,
        )  # fmt: skip
        self._chunks: dict[tuple, tuple[_Side, ...]] = {}
        # at P = 1 the send buffer is the receive buffer: a new one each call
        send = None if P == 1 else workspace("lowp_send", w.nbytes, torch.uint8, dev)[: w.nbytes]
        whole = _send_side(self.send_config, (0, 1), send)
        assert whole.wire == w
        self.pack, self.out = whole.pack, whole.out
        self.send, self.a2a = send, None if P == 1 else comm.all_to_all_launcher(send)
        self.recv_out = whole.recv_out
        # K's partial and final group amax: read by the pack only, so scratch (stream order
        # makes the next call's overwrite safe)
        n_ka = B * Hkv * lay_k.n_slots
        self.part = workspace("lowp_amax_part", n_ka, FP32, dev)[:n_ka].view(B, Hkv, -1)
        self.final = workspace("lowp_amax_final", n_ka, FP32, dev)[:n_ka].view(B, Hkv, -1)
        o = self.out
        self.gather_scales = whole.gather_scales
        self.out_bytes = output_template((o.nbytes,), torch.uint8, dev)
        self.mean_view, self.v_scale_view = o.mean, o.v_scale
        # exchange_to_heads: the codes dequantized by one launch into new [B, S, h, D] tensors
        self.dequant, self.heads_q, self.heads_kv = whole.dequant, whole.heads_q, whole.heads_kv
        self.dtype, self.fields = k.dtype, (c.used_sequence, c.q_group, c.k_group)
        self.v_code = _V_CODES[c.v_format]
        # a call's launches on views of its buffers, the views fixed here: on CUDA no view is
        # made per call (kernels/_launch.Views). Buffers: out = the result bytes, recv
        mean_at = View("out", k.dtype, *o.mean)
        self.post_at = self.post.bind(
            ("out", "part", "final"), mean_ptr=mean_at, part_ptr="part", final_ptr="final",
            v_scale_ptr=View("out", FP32, *o.v_scale),
        )  # fmt: skip
        recv_words = View("recv", FP32, (w.nbytes // 4,), (1,), 0)
        # at P = 1 the pack writes the receive buffer itself (a new one a call)
        send_at = {} if P > 1 else {"send_ptr": "recv"}
        self.pack_at = self.pack.bind(
            ("q", "k", "v", "amax_q", "amax_k", "out", "amax_v", *(("recv",) if send_at else ())),
            q_ptr="q", k_ptr="k", v_ptr="v", amax_q_ptr="amax_q", amax_k_ptr="amax_k",
            mean_ptr=mean_at, amax_v_ptr="amax_v", **send_at,
        )  # fmt: skip
        self.gather_at = self.gather_scales.bind(
            ("recv", "out"), recv_ptr=recv_words,
            out_ptr=View("out", FP32, (o.nbytes // 4,), (1,), 0),
        )  # fmt: skip
        # (recv, out, q_out, k_out, v_out): Q's and K's scales read from recv (no gather)
        self.dequant_at = whole.dequant_at
        # exchange_to_heads reads the receive buffer and the result bytes in the call only (the
        # dequantize): scratch there, reused in stream order (no allocation a call)
        self.scratch_recv = workspace("lowp_recv", w.nbytes, torch.uint8, dev)[: w.nbytes]
        self.scratch_out = workspace("lowp_out", o.nbytes, torch.uint8, dev)[: o.nbytes]
        self.a2a_scratch = None if P == 1 else comm.all_to_all_launcher(send, self.scratch_recv)

    def _stats(self, q, k, v, pg, out=None) -> torch.Tensor:
        """The statistics launches and the all_gather of one call: its result bytes (new, or
        ``out``)."""
        self.local_stats(k, q, v)
        if self.gather is not None:
            self.gather(pg)
        if out is None:
            out = torch.empty_like(self.out_bytes)
        self.post_at(out, self.part, self.final)
        return out

    def stats(self, q, k, v, pg) -> tuple[torch.Tensor, torch.Tensor]:
        """The statistics of one call, all heads: the local launches, the all_gather, the
        post-gather launch. Returns (result bytes, the global K mean view of them); K's final
        and Q's merged group amax and V's amax are in this plan's scratch buffers until its
        next call."""
        out = self._stats(q, k, v, pg)
        return out, out.view(self.dtype).as_strided(*self.mean_view)

    def chunk_sides(self, n: int, kv_once: bool = False) -> tuple[_Side, ...]:
        """The send sides of the ``n`` head chunks (built once, by :func:`_send_side`)."""
        sides = self._chunks.get((n, kv_once))
        if sides is None:
            sides = tuple(_send_side(self.send_config, (i, n), None, kv_once) for i in range(n))
            self._chunks[(n, kv_once)] = sides
        return sides

    def run(
        self, q, k, v, pg, scratch: bool = False, scales: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(receive buffer, result bytes) of one call: the kernels and collectives in order.
        New buffers, or with ``scratch`` the plan's scratch ones (valid until its next call).
        ``scales=False``: no scale gather (the result bytes then hold no q_scale, k_scale).
        Every launch is made from this frame (the chain from the layer stays short: DESIGN)."""
        self.local_stats(k, q, v)
        if self.gather is not None:
            self.gather(pg)
        out = self.scratch_out if scratch else torch.empty_like(self.out_bytes)
        self.post_at(out, self.part, self.final)
        if self.a2a is not None:
            self.pack_at(q, k, v, self.amax_q, self.final, out, self.amax_v)
            recv = (self.a2a_scratch if scratch else self.a2a)(pg)
        else:
            recv = self.scratch_recv if scratch else torch.empty_like(self.recv_out)
            self.pack_at(q, k, v, self.amax_q, self.final, out, self.amax_v, recv)
        if scales:
            self.gather_at(recv, out)
        return recv, out

    def __call__(self, q, k, v, pg) -> LowpQKV:
        recv, out = self.run(q, k, v, pg)
        return _result(self.out, recv, out, self.dtype, self.fields, self.v_code)

    def to_heads(self, q, k, v, pg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``self(q, k, v, pg).dequantize()`` without the LowpQKV: the same launches but the
        scale gather (the dequantize reads Q's and K's scales from the receive buffer), the
        same bits."""
        return self.dequantize(*self.run(q, k, v, pg, scratch=True, scales=False))

    def dequantize(self, recv, out) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head shards of a call's receive buffer and result bytes, new tensors: one
        launch reading Q's and K's scales in ``recv`` (no scale gather)."""
        heads = (torch.empty_like(self.heads_q), torch.empty_like(self.heads_kv),
                 torch.empty_like(self.heads_kv))  # fmt: skip
        self.dequant_at(recv, out, *heads)
        return heads


# Plans by call signature: shapes, strides, dtypes, devices, the group, every argument with its
# type, and the stream (the scratch buffers are per stream). The one cache of the exchange.
_PLANS = PlanCache(f"{__name__}._PLANS", max_plans=64)
clear_plans = _PLANS.clear  # after a rule of ``ulysses.grid`` changed


def _plan(q, k, v, group, used_sequence, q_group, k_group, enable_pdl, v_format="fp8") -> tuple:
    """(plan, process group) of a call: the cached plan of its signature, or a new one after
    validating every argument (which raises on bad ones). ``group=None`` without
    torch.distributed initialized keys on a group of ``None``: a plan exists only once the
    validation accepted that as a group of one."""
    if mesh.is_mesh_group(group):  # a DeviceMesh dimension: its process group, as the key
        group = mesh.mesh_group(group)
    pg = dist.group.WORLD if group is None else group
    if used_sequence is not None and type(used_sequence) is not int:
        used_sequence = grid.used_counts(used_sequence)  # per-row counts: a tuple
    try:  # an unhashable argument or a group of another type: the validation names it
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype,
               v.dtype, q.device, v.device, comm.group_key(pg), used_sequence, q_group, k_group,
               enable_pdl, type(used_sequence), type(q_group), type(k_group), type(enable_pdl),
               v_format, *stream_key(k.device))  # fmt: skip
        plan = _PLANS.get(key)
    except TypeError:
        key = plan = None
    if plan is not None and not (q.data_ptr() | k.data_ptr() | v.data_ptr()) & 15:
        stats.recheck(plan.check, pg)  # the ranks' check, every call
        return plan, pg
    c = _prepare(q, k, v, group, used_sequence, q_group, k_group, enable_pdl, v_format)
    plan = _ExchangePlan(c)
    plan.check = c.part.check
    return _PLANS.put(key, plan), c.pg
