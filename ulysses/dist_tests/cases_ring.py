"""Cases of the ``ring`` suite (``ulysses.ring.hybrid_attention``, Ulysses x Ring on a 2-D mesh):
what each case id means and how its inputs are built.

A case id reads ``{comm}-{P_r}x{P_u}-S{S}-H{Hq}kv{Hkv}-D{D}-{causal|full}-{layout}``
``-used_{kind}-B{B}[-big][-yunchang]``:

    part           meaning
    comm           bf16 (the blocks travel in the input dtype) or lowp (INT8 Q/K, FP8 V codes
                   on the ring, attended by the codes kernel)
    P_r x P_u      the mesh: ring size x Ulysses size (the case runs at world size P_r * P_u)
    S              global rows; each rank holds L = S / (P_r * P_u)
    Hq, Hkv        query and key/value heads (Hkv < P_u: K/V heads repeated over the
                   Ulysses ranks)
    D              head dim
    causal | full  causal attention, or every query attends every live key
    layout         contiguous (rank r holds rows [r*L, (r+1)*L)) or zigzag
                   (``ulysses.ring.zigzag_shard``)
    used_{kind}    none (no padding), tail (the last live row mid-way through the last
                   ring segment's first rank) or rows (one count per batch row: the tail, then
                   no padding)
    B{B}           batch size
    big            q and k scaled by 16: scores of several hundred, where a log-sum-exp merge
                   without its max shift overflows
    docs_packed    ``document_ids``: each batch row packs documents (boundaries drawn from
                   the seed: inside ranks and on a segment boundary)
    groups         the mesh passed as ``(ring_group, ulysses_group)`` (with "lowp": the
                   Ulysses all_to_all in the input dtype, statistics over the ring group)
    int8wire       ``int8_output=True`` and ``backward_comm="lowp"``: the output, d(out),
                   dq|dk|dv and the ring's dK|dV accumulators as INT8 with one fp32 scale a
                   (row, head)
    drift          K's channel means drift along the sequence (each segment's own mean far
                   from the global one)
    fault_{name}   a planted fault: of the ring's log-sum-exp merge (``unshifted``: no max
                   shift; ``drop_block``: ring step 1's partial never merged) or of the 8-bit
                   ring (``local_mean``: K centred on each rank's own mean, as per-shard
                   smoothing does); the case passes when the comparison with the reference
                   fails
    disagree_causal  rank 0 passes ``causal`` the other way: every rank must raise the same
                   ValueError naming it (the ranks' check covers the mesh shape too)
    yunchang       yunchang's test_hybrid_attn.py case (batch 1, 32 heads, head dim 40, bf16,
                   its forward tolerance atol 1e-2), the sequence scaled down

Every rank builds the same global q [B, S, Hq, D], k, v [B, S, Hkv, D] and output gradient
from the case's seed (crc32 of the id without the mesh, plus --seed: the meshes of one
world size attend the same data): q, v and the gradient standard normal, k
standard normal plus 2 (a channel mean, as K has), rows [used, S) zero; its rows are its
shard. The reference is each rank's own fp32 attention of the gathered sequence (lowp: of the
gather-then-quantize values, ``ulysses.reference.lowp_exchange_reference``).
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class Case:
    comm: str
    P_r: int
    P_u: int
    L: int
    Hq: int
    Hkv: int
    D: int
    causal: bool
    layout: str
    used: str = "none"
    B: int = 1
    big: bool = False
    yunchang: bool = False
    fault: str = ""
    disagree: bool = False
    drift: bool = False
    docs: bool = False
    int8_wire: bool = False  # int8_output=True and backward_comm="lowp"
    groups: bool = False  # the mesh as (ring_group, ulysses_group)

    @property
    def id(self) -> str:
        return f"{self.comm}-{self.P_r}x{self.P_u}-{self.data_id}"

    @property
    def data_id(self) -> str:
        """The id without the mesh: cases that differ only in the mesh get the same data."""
        return (
            f"S{self.L * self.P_r * self.P_u}-H{self.Hq}kv{self.Hkv}-D{self.D}-"
            f"{'causal' if self.causal else 'full'}-{self.layout}-used_{self.used}-B{self.B}"
            + ("-big" if self.big else "")
            + ("-drift" if self.drift else "")
            + ("-docs_packed" if self.docs else "")
            + ("-int8wire" if self.int8_wire else "")
            + ("-groups" if self.groups else "")
            + ("-yunchang" if self.yunchang else "")
            + (f"-fault_{self.fault}" if self.fault else "")
            + ("-disagree_causal" if self.disagree else "")
        )


# the meshes (P_r, P_u) each world size runs
MESHES = {
    1: [(1, 1)],
    2: [(2, 1)],
    4: [(2, 2), (4, 1), (1, 4)],
    6: [(2, 3), (3, 2)],
    8: [(2, 4), (4, 2), (8, 1), (1, 8)],
}


def mesh_cases(P_r: int, P_u: int) -> list[Case]:
    """The default cases of one mesh."""
    L = 16 if P_u > 1 else 32
    out = [
        Case("bf16", P_r, P_u, L, 2 * P_u, P_u, 32, True, "contiguous", "tail", B=2),
        Case("bf16", P_r, P_u, L, 2 * P_u, max(1, P_u // 2), 32, False, "contiguous"),
        Case("bf16", P_r, P_u, L, P_u, P_u, 32, True, "zigzag", big=P_r > 1),
        # the 8-bit ring: segments of whole 64-row K groups (zigzag: each half)
        Case(
            "lowp", P_r, P_u, 64 if P_u == 3 else 128 // P_u, 2 * P_u, P_u, 32, True, "contiguous"
        ),  # fmt: skip
    ]
    if P_u <= 2 and P_r > 1:
        out.append(Case("lowp", P_r, P_u, 128 // P_u, P_u, 1, 32, True, "zigzag"))
    if P_r > 1:  # the INT8 wire of a (row, head): the output, d(out), dq|dk|dv, the ring's dK|dV
        out.append(Case("lowp", P_r, P_u, 64 if P_u == 3 else 128 // P_u, 2 * P_u,
                        max(1, P_u // 2), 32, True, "zigzag" if P_u <= 2 else "contiguous",
                        int8_wire=True))  # fmt: skip
    if P_r > 1:  # two process groups for a mesh: the 8-bit ring's statistics on the ring group
        out.append(Case("lowp", P_r, P_u, 64 if P_u == 3 else 128 // P_u, 2 * P_u, P_u, 32,
                        True, "contiguous", "tail", B=2, groups=True))  # fmt: skip
    if P_r > 1:  # packed documents: blocks skipped, unmasked or masked
        out.append(Case("bf16", P_r, P_u, L, 2 * P_u, P_u, 32, True, "zigzag", B=2, docs=True))
        out.append(Case("lowp", P_r, P_u, 64 if P_u == 3 else 128 // P_u, P_u, P_u, 32, True,
                        "contiguous", docs=True))  # fmt: skip
    if P_r > 1 and P_u > 1:  # padding on the 8-bit ring: per-row statistics and masked blocks
        out.append(Case("lowp", P_r, P_u, 128 // P_u if P_u != 3 else 64, P_u, P_u, 32, False,
                        "contiguous", "rows", B=2))  # fmt: skip
    return out


def fault_cases(P_r: int, P_u: int) -> list[Case]:
    """The planted faults of the ring's merge (``ulysses.ring._merge_fault``), each on a case
    that shows it: such a case passes when the comparison with the reference FAILS."""
    if P_r == 1:
        return []
    L = 16 if P_u > 1 else 32
    Lq = 64 if P_u == 3 else 128 // P_u  # whole K groups a segment (the 8-bit ring)
    return [
        Case("bf16", P_r, P_u, L, P_u, P_u, 32, True, "zigzag", big=True, fault="unshifted"),
        Case("bf16", P_r, P_u, L, 2 * P_u, P_u, 32, False, "contiguous", fault="drop_block"),
        Case("lowp", P_r, P_u, Lq, P_u, P_u, 32, False, "contiguous", drift=True),
        Case(
            "lowp", P_r, P_u, Lq, P_u, P_u, 32, False, "contiguous", drift=True, fault="local_mean"
        ),  # fmt: skip
    ]


def yunchang_cases(P_r: int, P_u: int) -> list[Case]:
    """yunchang's test_hybrid_attn.py: bf16, batch 1, 32 heads of 40, causal or not, its ring
    kinds "basic" (our contiguous) and "zigzag"; sequence 1024 scaled to 32 rows a rank."""
    if 32 % P_u:
        return []
    return [
        Case("bf16", P_r, P_u, 32, 32, 32, 40, causal, layout, yunchang=True)
        for causal in (False, True)
        for layout in ("contiguous", "zigzag")
    ]


def lowp_degree_cases() -> list[Case]:
    """The same data at ring sizes 1, 2 and 4 (world size 4): the lowp bound holds at each."""
    return [
        Case("lowp", P_r, 4 // P_r, 256 // 4, 4, 4, 32, True, "contiguous", B=1)
        for P_r in (1, 2, 4)
    ]


def select_cases(*, large: bool = False, sweep: bool = False) -> list[Case]:
    """The cases of this run's world size (``WORLD_SIZE``, set by torchrun)."""
    P = int(os.environ.get("WORLD_SIZE", "1"))
    out = []
    for P_r, P_u in MESHES.get(P, [(P, 1)]):
        out += mesh_cases(P_r, P_u)
    out += fault_cases(*MESHES.get(P, [(P, 1)])[0])
    if P > 1:
        P_r, P_u = MESHES.get(P, [(P, 1)])[0]
        out.append(Case("bf16", P_r, P_u, 16, 2 * P_u, P_u, 32, True, "contiguous",
                        disagree=True))  # fmt: skip
    if P == 4:
        out += yunchang_cases(2, 2)
        out += [c for c in lowp_degree_cases() if c not in out]
    return out
