"""The loops of a kernel's SASS, counted, on a machine without a GPU: how many instructions
one trip of each loop issues, and of which kinds. For finding where a kernel spends its
issue slots before timing it.

    python tools/sass_loops.py [--kernel pack|amax|codes] [--config M,N,w,s,pv,opt]
                               [--shape B,L,H,D] [--arch 90] [--dump F]

``pack``: the exchange's pack launch as the eager plan makes it on a GPU (q_once, P = 2,
rank 1, q_group 32, k_group 64, bf16). ``amax``: ``k_grouped_amax`` at P = 8, rank 5,
G = 64 and 128. ``codes``: the codes attention (full, 64-row groups) on a head shard
B,S,h,D at ``--config`` (default: the kernel's GPU default). The launch is recorded, not
run (``tools/compile_sm90.py``'s recorder:
CPU tensors take the compiled path's settings), compiled for ``sm_<arch>`` with the
package's options, and disassembled with the cuobjdump that Triton ships. A loop is a
backward branch; its trip is the instructions from the branch target to the branch. One row
per loop of each specialization (PDL off: the recorder's PDL-on twins are skipped), with
the registers, and the ten most frequent opcodes of the longest loop.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compile_sm90 as cs  # noqa: E402
import torch  # noqa: E402

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def sass_lines(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of every instruction of the cubin."""
    out = []
    for line in cs._cubin_tool(cubin, "-sass").splitlines():
        m = _LINE.search(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def loops(lines: list[tuple[int, str]]) -> list[tuple[int, int, list[str]]]:
    """(start, end, instructions) of every backward branch's loop body."""
    found = []
    for addr, ins in lines:
        m = re.search(r"\bBRA\s+(?:`?\(?)0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            start = int(m.group(1), 16)
            body = [i for a, i in lines if start <= a <= addr]
            found.append((start, addr, body))
    return found


def opcode(ins: str) -> str:
    words = ins.split()
    op = words[1] if words[0].startswith("@") else words[0]
    return op.split(".")[0]


def record(kernel: str, shape: tuple[int, int, int, int], config: str = "") -> list[dict]:
    seen: dict[str, dict] = {}
    cs._install_recorder(seen)
    B, L, H, D = shape
    if kernel == "pack":
        from ulysses import grid, lowp
        from ulysses.kernels import lowp_pack

        P, rank, gq, gk = 2, 1, 32, 64
        w = lowp._wire(B, L, H, D, P, gq, gk)
        lay = grid.layout(rank, L, P, gq, None)
        once = lowp_pack.QOnce(lay.n_touched, lay.tail_group, lay.live_end, grid.FLOOR)
        x = torch.zeros(B, L, H, D, dtype=torch.bfloat16)
        send = torch.empty(w.nbytes, dtype=torch.uint8)
        launch = lowp_pack.prepare_pack(
            (B, L, H, D), (x.stride(),) * 3, torch.device("cpu"), send, world_size=P,
            row0=rank * L, q_group=gq, k_group=gk, n_sq=w.n_sq, n_sk=w.n_sk,
            row_bytes=w.row_bytes, scale_bytes=w.scale_bytes, use_pdl=False, q_once=once,
        )  # fmt: skip
        amax_q, amax_k = torch.ones(B, H, w.n_sq), torch.ones(B, H, w.n_sk)
        mean = torch.zeros(B, H, D, dtype=torch.bfloat16)
        launch(x, x, x, amax_q, amax_k, mean, torch.ones(B, H, D))
    elif kernel == "codes":
        from ulysses.kernels import codes_attention as ca

        # B, S, h, D: full attention on one head shard, 64-row Q and K groups
        cfg = ca.CodesConfig(*_config(config)) if config else ca.GPU_DEFAULT
        q = torch.zeros(B, L, H, D, dtype=torch.int8)
        v = torch.zeros(B, L, H, D, dtype=torch.float8_e4m3fn)
        n_g = -(-L // 64)
        sq = torch.ones(B, H, n_g)
        ca.codes_attention(q, q, v, sq, sq, torch.ones(B, H, D), q_group=64, k_group=64,
                           config=cfg)  # fmt: skip
    else:
        import ulysses

        k = torch.zeros(B, L, H, D, dtype=torch.bfloat16)
        mean = torch.zeros(B, H, D, dtype=torch.bfloat16)
        for g in (64, 128):
            ulysses.k_grouped_amax(k, mean, rank=5, world_size=8, group_size=g)
    specs = [s for s in seen.values() if not _constexprs(s).get("USE_PDL")]
    if kernel == "codes":  # the attention first (--dump), then the V transpose
        specs.sort(key=lambda s: s["kernel"] != "_codes_attn_fwd_kernel")
    return specs


def _config(text: str) -> tuple:
    """``M,N,warps,stages,pv,opt`` -> a CodesConfig's fields."""
    f = text.split(",")
    return (int(f[0]), int(f[1]), int(f[2]), int(f[3]), f[4], int(f[5]))


def _constexprs(spec: dict) -> dict:
    """A recorded specialization's constexprs by name."""
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    return {fn.arg_names[i]: v for i, v in spec["constexprs"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=("pack", "amax", "codes"), default="pack")
    ap.add_argument("--shape", default="1,32768,32,128", help="B,L,H,D (per rank)")
    ap.add_argument("--config", default="", help="codes: M,N,warps,stages,pv,opt")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dump", help="write the SASS of the first specialization here")
    args = ap.parse_args()
    import triton

    shape = tuple(int(v) for v in args.shape.split(","))
    print(f"# triton {triton.__version__}, sm_{args.arch}, {args.kernel} at B,L,H,D = {shape}")
    if not cs._cuobjdump():
        print("sass_loops: Triton's cuobjdump is missing; nothing to count")
        return 2
    for spec in record(args.kernel, shape, args.config):
        cubin = cs._compile(spec, args.arch).asm["cubin"]
        lines = sass_lines(cubin)
        usage = re.search(r"REG:(\d+)", cs._cubin_tool(cubin, "--dump-resource-usage"))
        consts = ", ".join(f"{k}={v}" for k, v in _constexprs(spec).items())
        print(f"## {spec['kernel']}, {spec['num_warps']} warps; {consts}")
        print(f"{len(lines)} instructions, {usage.group(1) if usage else '?'} registers")
        body_max: list[str] = []
        for start, end, body in loops(lines):
            print(f"  loop {start:#06x}-{end:#06x}: {len(body)} instructions a trip")
            body_max = max(body_max, body, key=len)
        if body_max:
            common = collections.Counter(opcode(i) for i in body_max).most_common(10)
            print("  longest loop: " + ", ".join(f"{op} {n}" for op, n in common))
        if args.dump:
            Path(args.dump).write_text("\n".join(f"{a:#06x} {i}" for a, i in lines) + "\n")
            args.dump = None
    return 0


if __name__ == "__main__":
    sys.exit(main())
