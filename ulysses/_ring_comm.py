"""The ring's transfers and the Ulysses all_to_alls of ``ulysses.ring`` (shape legend there).

Test seams: ``ring_link`` (a stand-in for the ring's P2P) and ``sent_bytes`` (the bytes this
process sent on the ring, both passes).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from . import comm as _comm

sent_bytes = 0
_COUNT_LOCK = threading.Lock()


# ---- the ring's transfers ----------------------------------------------------------------------


class _Transfer:
    """A started send to ring rank i+1 and receive from i-1; ``wait()`` -> the received
    tensor (ready on the current stream)."""

    def __init__(self, recv, works=(), event=None, device=None):
        self.recv, self.works, self.event, self.device = recv, list(works), event, device

    def wait(self) -> torch.Tensor:
        for w in self.works:
            w.wait()
        self.works = []
        if self.event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self.event)
            self.recv.record_stream(stream)
            self.event = None
        return self.recv


# A stand-in for the ring's P2P (scripts/bench_ring.py on one device, tests/unit/test_ring.py
# in threads): an object with ``send_recv(recv, send, i, P_r)`` that fills ``recv`` (what
# ring rank i - 1 sent), ordered on the current stream; None: the backend.
ring_link = None


def _start(send: torch.Tensor, g, tag: int = 0) -> _Transfer:
    """Send ``send`` to ring rank i+1 and receive the same shape from i-1, without waiting
    (CUDA: on the communication stream, beside the current stream's attention)."""
    global sent_bytes
    with _COUNT_LOCK:  # (ranks as threads in the tests: an update is never lost)
        sent_bytes += send.numel() * send.element_size()
    recv = torch.empty_like(send)
    if ring_link is not None:
        if send.is_cuda:
            stream = _comm._side_stream(send.device)
            stream.wait_stream(torch.cuda.current_stream(send.device))
            with torch.cuda.stream(stream):
                ring_link.send_recv(recv, send, g.i, g.P_r)
                event = torch.cuda.Event()
                event.record(stream)
            send.record_stream(stream)
            recv.record_stream(stream)
            return _Transfer(recv, event=event, device=send.device)
        ring_link.send_recv(recv, send, g.i, g.P_r)
        return _Transfer(recv)
    nxt = dist.get_global_rank(g.ring_pg, (g.i + 1) % g.P_r)
    prv = dist.get_global_rank(g.ring_pg, (g.i - 1) % g.P_r)

    def issue():
        ops = [dist.P2POp(dist.isend, send, nxt, g.ring_pg, tag),
               dist.P2POp(dist.irecv, recv, prv, g.ring_pg, tag)]  # fmt: skip
        return dist.batch_isend_irecv(ops)

    if not send.is_cuda:
        return _Transfer(recv, works=issue())
    stream = _comm._side_stream(send.device)
    stream.wait_stream(torch.cuda.current_stream(send.device))
    with torch.cuda.stream(stream):
        for w in issue():
            w.wait()
        event = torch.cuda.Event()
        event.record(stream)
    send.record_stream(stream)
    recv.record_stream(stream)
    return _Transfer(recv, event=event, device=send.device)


def _flat(tensors) -> torch.Tensor:
    """Tensors as one flat uint8 buffer (one transfer a step)."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


def _unflat(buf: torch.Tensor, like) -> list[torch.Tensor]:
    out, o = [], 0
    for t in like:
        n = t.numel() * t.element_size()
        out.append(buf[o : o + n].view(t.dtype).view(t.shape))
        o += n
    return out


def ring_block_bytes(B: int, S_seg: int, hkv: int, D: int, *, comm: str = "bf16",
                     element_size: int = 2, k_group: int = 64) -> int:  # fmt: skip
    """The bytes one ring step sends in forward: K and V of a segment's head shard,
    ``2 * B * S_seg * hkv * D * element_size`` in the input dtype, or with ``comm="lowp"``
    one byte a code plus K's fp32 group scales (``4 * B * hkv * S_seg / k_group``)."""
    n = B * S_seg * hkv * D
    if comm == "lowp":
        return 2 * n + 4 * B * hkv * (S_seg // k_group)
    return 2 * n * element_size


# ---- the Ulysses all_to_alls -------------------------------------------------------------------


def _to_heads(q, k, v, g, hkv: int):
    """Sequence shards -> q_h [B, S_seg, hq, D], k_h, v_h [B, S_seg, hkv, D]: ONE all_to_all
    of q|k|v packed per Ulysses destination (K/V heads repeated when P_u % Hkv == 0)."""
    B, L, Hq, D = q.shape
    P = g.P_u
    if k.shape[2] < P:
        k, v = (x.repeat_interleave(P // x.shape[2], dim=2) for x in (k, v))
    send = torch.cat([q.view(B, L, P, Hq // P, D), k.view(B, L, P, hkv, D),
                      v.view(B, L, P, hkv, D)], dim=3)  # fmt: skip
    send = send.permute(2, 0, 1, 3, 4).contiguous()  # [P dest, B, L, hq + 2 hkv, D]
    recv = _comm.all_to_all(send, g.uly_pg, P)  # [P src, B, L, w, D]
    x = recv.permute(1, 0, 2, 3, 4).reshape(B, P * L, -1, D)
    hq = Hq // P
    return x[:, :, :hq], x[:, :, hq : hq + hkv], x[:, :, hq + hkv :]


def _out_to_seq(out_h, g, L: int):
    """[B, S_seg, hq, D] -> [B, L, Hq, D]: ONE all_to_all."""
    B, _, hq, D = out_h.shape
    P = g.P_u
    send = out_h.reshape(B, P, L, hq, D).permute(1, 0, 2, 3, 4).contiguous()
    recv = _comm.all_to_all(send, g.uly_pg, P)  # [P head blocks, B, L, hq, D]
    return recv.permute(1, 2, 0, 3, 4).reshape(B, L, P * hq, D)


def _dout_to_heads(dout, g, hq: int):
    """[B, L, Hq, D] -> [B, S_seg, hq, D]: ONE all_to_all (the inverse of _out_to_seq)."""
    B, L, Hq, D = dout.shape
    P = g.P_u
    send = dout.reshape(B, L, P, hq, D).permute(2, 0, 1, 3, 4).contiguous()
    recv = _comm.all_to_all(send, g.uly_pg, P)  # [P row blocks, B, L, hq, D]
    return recv.permute(1, 0, 2, 3, 4).reshape(B, P * L, hq, D)


def _grads_to_seq(dq_h, dk_h, dv_h, g, Hkv: int):
    """Head shards' gradients -> dq [B, L, Hq, D], dk, dv [B, L, Hkv, D]: ONE all_to_all of
    dq|dk|dv (a repeated K/V head's partials summed in fp32)."""
    B, S_seg, hq, D = dq_h.shape
    hkv = dk_h.shape[2]
    P = g.P_u
    L = S_seg // P
    x = torch.cat([dq_h, dk_h, dv_h], dim=2).reshape(B, P, L, hq + 2 * hkv, D)
    recv = _comm.all_to_all(x.permute(1, 0, 2, 3, 4).contiguous(), g.uly_pg, P)
    recv = recv.permute(1, 2, 0, 3, 4)  # [B, L, P head blocks, w, D]
    dq = recv[..., :hq, :].reshape(B, L, P * hq, D)
    dk, dv = (recv[..., a : a + hkv, :].reshape(B, L, P * hkv, D)
              for a in (hq, hq + hkv))  # fmt: skip
    if P * hkv > Hkv:  # repeated heads: sum the ranks' partials
        dk, dv = (x.unflatten(2, (Hkv, -1)).float().sum(3).to(dq.dtype) for x in (dk, dv))
    return dq, dk, dv


def _exchange_codes(q, k, v, g, cfg, hkv: int):
    """Sequence shards -> the segment's codes (``_ring_blocks._Codes`` of q_h [B, S_seg, hq,
    D], k_h, v_h [B, S_seg, hkv, D]): statistics of the whole sequence over the world group
    (``g.world_pg``, ranks in the mesh's numbering), this rank's rows quantized, then ONE
    all_to_all of uint8 codes and the Q/K group scales in the Ulysses group (one byte an
    element where bf16 sends two; V's scales are global and do not travel). Every group of
    ``q_group`` and ``k_group`` rows lies within one rank (L a multiple of both)."""
    from . import _ring_blocks as blocks

    B, L, Hq, D = q.shape
    P = g.P_u
    hq = Hq // P
    live = blocks._segment_used(cfg.used, g.rank, L)
    x = blocks._codes_of(q, k, v, g.world_pg, g.rank, g.P_r * P, live, cfg)
    kc, vc, ks, vs = x.k, x.v, x.k_scale, x.v_scale
    if kc.shape[2] < P:  # one K/V head a rank: each repeated to the ranks that use it
        rep = P // kc.shape[2]
        kc, vc = (t.repeat_interleave(rep, dim=2) for t in (kc, vc))
        ks, vs = (t.repeat_interleave(rep, dim=1) for t in (ks, vs))
    u8 = torch.uint8
    codes = torch.cat([x.q.view(u8).view(B, L, P, hq, D), kc.view(u8).view(B, L, P, hkv, D),
                       vc.view(u8).view(B, L, P, hkv, D)], dim=3)  # fmt: skip
    codes = codes.permute(2, 0, 1, 3, 4).reshape(P, -1)  # [P dest, B * L * w * D]
    nq, nk = L // cfg.q_group, L // cfg.k_group
    q_s = x.q_scale.view(B, P, hq, nq).permute(1, 0, 2, 3).reshape(P, -1)
    k_s = ks.view(B, P, hkv, nk).permute(1, 0, 2, 3).reshape(P, -1)
    scales = torch.cat([q_s, k_s], dim=1)
    send = torch.cat([codes, scales.contiguous().view(u8)], dim=1)
    recv = _comm.all_to_all(send, g.uly_pg, P)  # [P src, bytes]: sender order = row order
    nc = codes.shape[1]
    c = recv[:, :nc].view(P, B, L, hq + 2 * hkv, D).permute(1, 0, 2, 3, 4)
    c = c.reshape(B, P * L, hq + 2 * hkv, D)
    s = recv[:, nc:].contiguous().view(torch.float32)  # [P src, scales]
    n_qs = B * hq * nq
    q_scale = s[:, :n_qs].view(P, B, hq, nq).permute(1, 2, 0, 3).reshape(B, hq, P * nq)
    k_scale = s[:, n_qs:].view(P, B, hkv, nk).permute(1, 2, 0, 3).reshape(B, hkv, P * nk)
    return blocks._Codes(
        c[:, :, :hq].view(torch.int8),
        c[:, :, hq : hq + hkv].contiguous().view(torch.int8),
        c[:, :, hq + hkv :].contiguous().view(x.v.dtype),
        q_scale.contiguous(),
        k_scale.contiguous(),
        vs[:, g.u * hkv : (g.u + 1) * hkv].contiguous(),
        cfg.q_group,
        cfg.k_group,
    )


# ---- the INT8 wire of a (row, head) (int8_output, backward_comm="lowp": ulysses.rowwire) -------


def _out_to_seq_int8(out_h, g, L: int):
    """:func:`_out_to_seq` with the output as INT8 codes and one fp32 scale a (row, head)."""
    from . import rowwire

    B, _, hq, D = out_h.shape
    send = rowwire.out_quant_op(x=out_h.contiguous(), world_size=g.P_u)
    recv = _comm.all_to_all(send, g.uly_pg, g.P_u)
    return rowwire.out_dequant_op(recv=recv, B=B, L=L, h=hq, D=D, world_size=g.P_u,
                                  dtype=out_h.dtype)  # fmt: skip


def _dout_to_heads_int8(dout, g, hq: int):
    """:func:`_dout_to_heads` with d(out) as INT8 codes and one fp32 scale a (row, head)."""
    from . import rowwire

    B, L, _, D = dout.shape
    send = rowwire.dout_quant_op(x=dout.contiguous(), world_size=g.P_u)
    recv = _comm.all_to_all(send, g.uly_pg, g.P_u)
    return rowwire.dout_dequant_op(recv=recv, B=B, L=L, h=hq, D=D, world_size=g.P_u,
                                   dtype=dout.dtype)  # fmt: skip


def _grads_to_seq_int8(dq_h, dk_h, dv_h, g, Hkv: int):
    """:func:`_grads_to_seq` with dq|dk|dv as INT8 codes and one fp32 scale a (row, head)."""
    from . import rowwire

    B, S_seg, hq, D = dq_h.shape
    hkv = dk_h.shape[2]
    P = g.P_u
    send = rowwire.grads_quant_op(dq=dq_h.contiguous(), dk=dk_h.contiguous(),
                                  dv=dv_h.contiguous(), world_size=P)  # fmt: skip
    recv = _comm.all_to_all(send, g.uly_pg, P)
    dq, dk, dv = rowwire.grads_dequant_op(recv=recv, B=B, L=S_seg // P, hq=hq, hkv=hkv, D=D,
                                          world_size=P, dtype=dq_h.dtype)  # fmt: skip
    if P * hkv > Hkv:  # repeated heads: the ranks' partials summed in fp32, rank order
        dk, dv = (x.unflatten(2, (Hkv, -1)).float().sum(3).to(dq.dtype) for x in (dk, dv))
    return dq, dk, dv


def _dkv_wire(dkv, dtype, lowp: bool) -> torch.Tensor:
    """What a ring hop carries of a block's dK|dV accumulator [2, B, S_seg, hkv, D] fp32:
    itself, or (``backward_comm="lowp"``) INT8 codes and one fp32 scale a (row, head) of its
    rounding to ``dtype``."""
    if not lowp:
        return dkv
    from . import rowwire

    x = torch.cat([dkv[0], dkv[1]], dim=2).to(dtype)  # [B, S_seg, 2 hkv, D]
    return rowwire.out_quant_op(x=x, world_size=1)


def _dkv_unwire(recv, like, dtype, lowp: bool) -> torch.Tensor:
    """The inverse of :func:`_dkv_wire`: fp32 [2, B, S_seg, hkv, D] like ``like``."""
    if not lowp:
        return recv
    from . import rowwire

    _, B, S_seg, hkv, D = like.shape
    x = rowwire.out_dequant_op(recv=recv, B=B, L=S_seg, h=2 * hkv, D=D, world_size=1,
                               dtype=dtype)  # fmt: skip
    return torch.stack([x[:, :, :hkv], x[:, :, hkv:]]).float()
