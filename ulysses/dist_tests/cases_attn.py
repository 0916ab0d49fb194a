"""Cases of the ``attention`` suite (``ulysses.ulysses_attention``): what each case id means and
how its inputs are built.

A case id reads ``{comm}-L{L}-hq{hq}-{kv}-D{D}-{dtype}-{causal|full}-used_{kind}[-B{B}]``
``[-docs_packed][-disagree_{field}]`` (the uneven head kinds drop ``hq{hq}``):

    part           meaning
    comm           bf16 (exchange in the input dtype), lowp (INT8 Q/K, FP8 V), lowp8 (lowp,
                   and the output back as INT8: ``int8_output=True``), lowpbw (lowp, and the
                   backward's all-to-alls as INT8: ``backward_comm="lowp"``) or lowpbw8
                   (lowpbw with ``int8_output=True``)
    L              local rows per rank; the global sequence has S = L * P rows
    hq             query heads per rank: Hq = hq * P at world size P
    kv             key/value heads: mha (Hkv = Hq); gqa (Hkv = P: K/V heads sharded, one per
                   rank); gqarep (Hkv = P / 2, or 1 at odd P: each K/V head repeated to
                   several ranks); mqa (Hkv = 1)
    D, dtype       head dim; bf16, fp16 or fp32 (fp32 only with comm bf16)
    causal | full  causal attention, or every query attends every live key
    used_<kind>    none (no padding); tail (the last live row mid-way through the last rank);
                   early (the last live row mid-way through rank P/2 - 1: later ranks hold
                   only padding, whose keys a non-causal call must mask); rows (one count
                   per batch row: tail, early, then the whole sequence, repeating);
                   rows_edge (one count per batch row: a rank boundary L * max(1, P // 2),
                   mid-way through a Q and a K group of "lowp", then tail, then the whole
                   sequence, repeating)
    B{B}           batch size (1 when absent)
    win{l}_{r}     ``attn_kwargs={"window_size": (l, r)}``: query i attends keys [i - l, i + r]
    vint8          ``v_format="int8"``: V sent as INT8 with one global scale per (head, channel)
    docs_packed    ``document_ids``: each batch row packs several documents (boundaries
                   inside ranks and on rank boundaries, drawn from the case's seed)
    codes          ``attn="codes"``: the layer attends on the exchange's 8-bit codes
                   (``ulysses.codes``; on CPU Triton's interpreter runs the kernel); K's
                   64-row groups alternate between 1x and 2x the generated values, so that
                   neighbouring K groups have very different scales
    compiled       the call runs inside ``torch.compile(fullgraph=True)`` (backend
                   "aot_eager": the traced graph runs the eager kernels): its collectives are
                   the package's ops in the graph. The values are checked as in eager; the
                   collectives, logged through a link, against an eager call's
    disagree_used_sequence
                   rank r passes ``used_sequence = used - r``: every rank must raise the
                   same ValueError naming used_sequence and the per-rank values

Every rank builds the same global q [B, S, Hq, D], k, v [B, S, Hkv, D] and output gradient
[B, S, Hq, D] with ``ulysses.testing.make_k_full`` (seed: crc32 of the case id plus --seed;
q, v and the gradient standard normal; k with channel means 4x its spread, as K has), rows
[used, S) of q, k, v zero, and takes its rows as its shard.
"""

from __future__ import annotations

import dataclasses

import torch

from ulysses import testing

from .cases import case_seed, tiers

COMMS = ("bf16", "lowp", "lowp8", "lowpbw", "lowpbw8")
KV_KINDS = ("mha", "gqa", "gqarep", "mqa", "odd", "g40", "kv3")
UNEVEN_KINDS = ("odd", "g40", "kv3")
USED_KINDS = ("none", "tail", "early", "rows", "rows_edge")
DOCS_KINDS = ("none", "packed")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclasses.dataclass(frozen=True)
class Case:
    comm: str
    L: int
    hq: int
    kv: str
    D: int
    dtype: str
    causal: bool
    used: str
    B: int = 1
    docs: str = "none"
    disagree: str = ""
    window: tuple[int, int] | None = None
    chunks: int = 1  # head_chunks
    v_format: str = "fp8"  # comm="lowp": V's codes, "fp8" or "int8"
    compiled: bool = False  # the call inside torch.compile(fullgraph=True)
    attn: str | None = None  # "codes": attn="codes" (the attention on the exchange's codes)
    # a feature whose rules act within a batch row, channel or head, not across ranks: its
    # case runs at world sizes up to this one (the lowp suite covers every world size's grid)
    max_world: int | None = None

    @property
    def lowp(self) -> bool:
        """The call sends q, k, v in low precision (``comm="lowp"``)."""
        return self.comm in ("lowp", "lowp8", "lowpbw", "lowpbw8")

    @property
    def int8_output(self) -> bool:
        """The output returns as INT8 (``int8_output=True``)."""
        return self.comm in ("lowp8", "lowpbw8")

    @property
    def backward_comm(self) -> str:
        """``backward_comm`` of the call: "lowp" sends the gradients as INT8."""
        return "lowp" if self.comm in ("lowpbw", "lowpbw8") else "bf16"

    @property
    def id(self) -> str:
        heads = [self.kv] if self.kv in UNEVEN_KINDS else [f"hq{self.hq}", self.kv]
        parts = [self.comm, f"L{self.L}", *heads, f"D{self.D}", self.dtype]
        parts += ["causal" if self.causal else "full", f"used_{self.used}"]
        if self.B != 1:
            parts.append(f"B{self.B}")
        if self.docs != "none":
            parts.append(f"docs_{self.docs}")
        if self.window is not None:
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        if self.chunks != 1:
            parts.append(f"hc{self.chunks}")
        if self.v_format != "fp8":
            parts.append(f"v{self.v_format}")
        if self.attn is not None:
            parts.append(self.attn)
        if self.compiled:
            parts.append("compiled")
        if self.disagree:
            parts.append(f"disagree_{self.disagree}")
        return "-".join(parts)

    def heads(self, world_size: int) -> tuple[int, int]:
        """(Hq, Hkv) at this world size."""
        P = world_size
        uneven = {"odd": (2 * P - 1, 2 * P - 1), "g40": (40, 8), "kv3": (3 * (P + 1), 3)}
        if self.kv in uneven:
            return uneven[self.kv]
        Hq = self.hq * world_size
        Hkv = {
            "mha": Hq,
            "gqa": world_size,
            "gqarep": world_size // 2 if world_size % 2 == 0 else 1,
            "mqa": 1,
        }[self.kv]
        return Hq, Hkv


def resolve_used(kind: str, L: int, world_size: int, B: int = 1):
    """The global live-row count of a used kind at this world size (a tuple of B counts for
    ``rows``)."""
    if kind == "none":
        return None
    if kind == "rows":
        cycle = (resolve_used("tail", L, world_size), resolve_used("early", L, world_size))
        return tuple((*cycle, L * world_size)[b % 3] for b in range(B))
    if kind == "rows_edge":
        cycle = (L * max(1, world_size // 2), resolve_used("tail", L, world_size))
        return tuple((*cycle, L * world_size)[b % 3] for b in range(B))
    rank = world_size - 1 if kind == "tail" else max(0, world_size // 2 - 1)
    return rank * L + L // 2 + 1


DEFAULT_CASES = (
    Case("bf16", L=40, hq=2, kv="mha", D=64, dtype="bf16", causal=True, used="none", B=2),
    Case("bf16", L=40, hq=2, kv="mha", D=64, dtype="bf16", causal=False, used="tail"),
    Case("bf16", L=37, hq=2, kv="gqa", D=64, dtype="fp16", causal=True, used="early"),
    Case("bf16", L=40, hq=1, kv="gqarep", D=64, dtype="bf16", causal=True, used="none"),
    Case("bf16", L=33, hq=1, kv="mqa", D=64, dtype="bf16", causal=False, used="early", B=2),
    Case("bf16", L=24, hq=2, kv="mha", D=32, dtype="fp32", causal=False, used="tail"),
    Case("lowp", L=40, hq=2, kv="mha", D=64, dtype="bf16", causal=True, used="none"),
    Case("lowp", L=40, hq=2, kv="mha", D=64, dtype="bf16", causal=False, used="tail", B=2),
    Case("lowp", L=37, hq=2, kv="gqa", D=64, dtype="fp16", causal=False, used="early"),
    Case("lowp", L=33, hq=1, kv="mqa", D=64, dtype="bf16", causal=True, used="tail"),
    Case("lowp8", L=40, hq=2, kv="mha", D=64, dtype="bf16", causal=True, used="tail", B=2),
    Case("lowp8", L=37, hq=2, kv="gqarep", D=32, dtype="fp16", causal=False, used="early"),
    Case("lowpbw", L=40, hq=2, kv="mha", D=64, dtype="bf16", causal=True, used="none", B=2),
    Case("lowpbw", L=40, hq=2, kv="mha", D=64, dtype="bf16", causal=False, used="tail"),
    Case("lowpbw", L=37, hq=2, kv="gqa", D=64, dtype="fp16", causal=True, used="early"),
    Case("lowpbw", L=33, hq=1, kv="gqarep", D=32, dtype="bf16", causal=False, used="tail"),
    Case("lowpbw8", L=40, hq=2, kv="mha", D=32, dtype="fp16", causal=True, used="early", B=2),
    # a head dim that is not a power of two (the kernels' masked channel block)
    Case(
        "lowpbw8", L=20, hq=2, kv="gqa", D=80, dtype="bf16", causal=True, used="tail", max_world=4
    ),  # fmt: skip
    # V as INT8 with global per-(head, channel) scales (v_format="int8")
    Case(
        "lowp",
        L=24,
        hq=1,
        kv="mha",
        D=32,
        dtype="bf16",
        causal=False,
        used="tail",
        v_format="int8",
        max_world=4,
    ),  # fmt: skip
    # head counts that do not split evenly over the ranks
    Case("bf16", L=5, hq=0, kv="odd", D=16, dtype="bf16", causal=True, used="tail"),
    Case("bf16", L=6, hq=0, kv="g40", D=16, dtype="bf16", causal=False, used="none"),
    Case("bf16", L=5, hq=0, kv="kv3", D=16, dtype="fp16", causal=True, used="early", B=2),
    # per-row live counts, packed documents
    Case("bf16", L=10, hq=1, kv="mha", D=16, dtype="bf16", causal=True, used="rows", B=3),
    Case(
        "bf16",
        L=12,
        hq=1,
        kv="gqa",
        D=16,
        dtype="bf16",
        causal=True,
        used="tail",
        B=2,
        docs="packed",
    ),  # fmt: skip
    Case(
        "bf16",
        L=10,
        hq=2,
        kv="mha",
        D=16,
        dtype="fp32",
        causal=False,
        used="rows",
        B=3,
        docs="packed",
    ),  # fmt: skip
    Case(
        "lowp",
        L=12,
        hq=1,
        kv="mha",
        D=16,
        dtype="bf16",
        causal=False,
        used="early",
        B=2,
        docs="packed",
        max_world=4,
    ),  # fmt: skip
    # "lowp" with per-row counts: each batch row's statistics over its own live rows
    Case(
        "lowp",
        L=10,
        hq=1,
        kv="mha",
        D=16,
        dtype="bf16",
        causal=False,
        used="rows_edge",
        B=3,
        max_world=4,
    ),
    Case(
        "lowpbw",
        L=10,
        hq=1,
        kv="gqa",
        D=16,
        dtype="fp16",
        causal=True,
        used="rows_edge",
        B=3,
        max_world=4,
    ),  # fmt: skip
    # the all_to_alls pipelined over two head chunks (head_chunks=2; hkv = 2 a rank)
    Case("bf16", L=24, hq=2, kv="mha", D=32, dtype="bf16", causal=True, used="tail", B=2, chunks=2),
    Case("lowpbw8", L=24, hq=2, kv="mha", D=32, dtype="bf16", causal=False, used="early", chunks=2),
    # torch.compile(fullgraph=True) of the call: the graph's all_to_all ops (bf16), the
    # exchange, INT8 output and INT8 backward ops (lowpbw8)
    Case(
        "bf16",
        L=12,
        hq=1,
        kv="gqa",
        D=16,
        dtype="bf16",
        causal=True,
        used="tail",
        B=2,
        compiled=True,
    ),  # fmt: skip
    Case(
        "lowpbw8",
        L=12,
        hq=1,
        kv="mha",
        D=16,
        dtype="bf16",
        causal=False,
        used="early",
        compiled=True,
    ),  # fmt: skip
    # a sliding window across rank boundaries (attn_kwargs={"window_size": ...})
    Case(
        "bf16",
        L=9,
        hq=1,
        kv="gqa",
        D=16,
        dtype="bf16",
        causal=True,
        used="tail",
        B=2,
        window=(5, 0),
    ),  # fmt: skip
    Case(
        "lowp",
        L=12,
        hq=2,
        kv="mha",
        D=16,
        dtype="bf16",
        causal=False,
        used="none",
        window=(6, 2),
        max_world=4,
    ),  # fmt: skip
    # the attention on the exchange's codes (attn="codes"): GQA within a rank, causal; per-row
    # counts, documents, the INT8 output and backward wires; V as INT8, padding, compiled
    Case("lowp", L=40, hq=2, kv="gqa", D=64, dtype="bf16", causal=True, used="none", attn="codes"),
    # D 128: Hopper's warpgroup-MMA kernel on a GPU (the Triton kernel on CPU)
    Case(
        "lowp", L=40, hq=2, kv="gqa", D=128, dtype="bf16", causal=False, used="tail", attn="codes"
    ),  # fmt: skip
    Case(
        "lowpbw8",
        L=16,
        hq=1,
        kv="mha",
        D=32,
        dtype="fp16",
        causal=False,
        used="rows",
        B=3,
        docs="packed",
        attn="codes",
        max_world=4,
    ),
    Case(
        "lowp",
        L=24,
        hq=1,
        kv="gqarep",
        D=32,
        dtype="bf16",
        causal=True,
        used="early",
        v_format="int8",
        attn="codes",
        compiled=True,
        max_world=4,
    ),
    # the codes of each head chunk attended where they land (K/V with the first chunk)
    Case(
        "lowpbw8",
        L=24,
        hq=2,
        kv="gqa",
        D=32,
        dtype="bf16",
        causal=True,
        used="early",
        attn="codes",
        chunks=2,
    ),  # fmt: skip
    # ranks that disagree: the same ValueError on every rank (a shape no other case uses)
    Case(
        "bf16",
        L=11,
        hq=1,
        kv="mha",
        D=16,
        dtype="bf16",
        causal=False,
        used="tail",
        disagree="used_sequence",
    ),  # fmt: skip
)

# GPU-sized cases (--large)
LARGE_CASES = (
    Case("bf16", L=2048, hq=4, kv="gqa", D=128, dtype="bf16", causal=True, used="tail"),
    Case("lowp", L=2048, hq=4, kv="mha", D=128, dtype="bf16", causal=True, used="none"),
    Case("lowp", L=1000, hq=2, kv="gqarep", D=128, dtype="bf16", causal=False, used="early"),
    Case("lowp8", L=2048, hq=4, kv="mha", D=128, dtype="bf16", causal=True, used="tail"),
    Case("lowpbw", L=2048, hq=4, kv="gqa", D=128, dtype="bf16", causal=True, used="tail"),
    Case("lowpbw8", L=1000, hq=2, kv="gqarep", D=128, dtype="bf16", causal=False, used="early"),
    Case(
        "lowpbw",
        L=2048,
        hq=4,
        kv="gqa",
        D=128,
        dtype="bf16",
        causal=True,
        used="rows",
        B=2,
        docs="packed",
        attn="codes",
    ),
)


def select_cases(*, large: bool, sweep: bool) -> list[Case]:
    """The default cases; with ``large`` also the GPU-sized ones (no sweep)."""
    return tiers(DEFAULT_CASES, LARGE_CASES, (), large=large, sweep=sweep)


def document_ids(case: Case, world_size: int, base_seed: int):
    """The global document ids [B, S] of a ``docs_packed`` case (None otherwise): per batch
    row 1 to 5 documents with boundaries drawn from the case's seed, one of them on a rank
    boundary, ids non-decreasing and skipping values now and then."""
    if case.docs == "none":
        return None
    S = case.L * world_size
    gen = torch.Generator().manual_seed(case_seed(case, base_seed) + 7)
    rows = []
    for b in range(case.B):
        cuts = torch.randint(1, S, (b % 5,), generator=gen).tolist()
        cuts = sorted({*cuts, case.L * (world_size // 2)} - {0})
        ids, doc = torch.zeros(S, dtype=torch.int64), 0
        for c in cuts:
            doc += 1 + (c % 2)
            ids[c:] = doc
        rows.append(ids)
    return torch.stack(rows)


def build_full(case: Case, world_size: int, used, device, base_seed: int):
    """(q, k, v, grad_out) of the whole sequence, identical on every rank."""
    Hq, Hkv = case.heads(world_size)
    S, dtype, seed = case.L * world_size, DTYPES[case.dtype], case_seed(case, base_seed)

    def make(H, data, i, used_rows, **kw):
        per_row = isinstance(used_rows, tuple)
        x = testing.make_k_full(
            case.B, S, H, case.D, dtype, data, used=None if per_row else used_rows,
            seed=seed + i, **kw,
        )  # fmt: skip
        if per_row:  # rows [used_b, S) of batch row b zero
            for b, n in enumerate(used_rows):
                x[b, n:] = 0
        return x.to(device)

    q = make(Hq, "randn", 1, used)
    k = make(Hkv, "smooth", 2, used, mean_scale=4.0, spread=1.0)
    if case.attn == "codes":  # odd 64-row groups 2x (exact): a K scale read off by a row shows
        odd = (torch.arange(S, device=k.device) // 64) % 2 == 1
        k = k * torch.where(odd, 2.0, 1.0).to(k.dtype)[None, :, None, None]
    v = make(Hkv, "randn", 3, used)
    grad_out = make(Hq, "randn", 4, None)
    return q, k, v, grad_out
