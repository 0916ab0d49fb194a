"""Packed-document attention on one CUDA GPU: ``document_attention``'s two paths, SDPA per
document slice and flex_attention with a block mask, forward and forward + backward per
document count (what ``impl="auto"``'s rule in ulysses/documents.py was calibrated on).

    python3 scripts/bench_documents.py          (one GPU; about a minute, mostly compiling flex)

Per shape it prints the plan's cost, the block mask's, a flex step on a new plan, the
``triton.testing.do_bench`` times of each path and the largest difference between them.
"""

import time

import torch
import triton.testing as tt

from ulysses import documents as docs
from ulysses.documents import document_attention, document_ids_from_cu_seqlens, plan_documents

torch.manual_seed(0)
dev = "cuda"
print(torch.__version__, torch.cuda.get_device_name())


def run(B, S, hq, hkv, D, n, causal, dtype=torch.bfloat16):
    cu = [round(i * S / n) for i in range(n + 1)]
    ids = document_ids_from_cu_seqlens(cu, batch=B).to(dev)
    q = torch.randn(B, S, hq, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(B, S, hkv, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, S, hkv, D, device=dev, dtype=dtype, requires_grad=True)
    do = torch.randn_like(q)
    t = time.time()
    plan = plan_documents(ids)
    torch.cuda.synchronize()
    t_plan = time.time() - t
    res = {}
    outs = {}
    for impl in ("slices", "flex"):

        def step():
            o = document_attention(q, k, v, document_ids=plan, causal=causal, impl=impl)
            o.backward(do)
            return o

        t = time.time()
        outs[impl] = step().detach()
        torch.cuda.synchronize()
        first = time.time() - t

        def fwd():
            return document_attention(q, k, v, document_ids=plan, causal=causal, impl=impl)

        ms_fb = tt.do_bench(step, warmup=5, rep=40)
        ms_f = tt.do_bench(fwd, warmup=5, rep=40)
        res[impl] = (first, ms_f, ms_fb)
    # a second plan of the same shape: does flex recompile? (block mask built + kernel)
    ids2 = ids.clone()
    plan2 = plan_documents(ids2)
    t = time.time()
    o = document_attention(q, k, v, document_ids=plan2, causal=causal, impl="flex")
    o.backward(do)
    torch.cuda.synchronize()
    t_new_plan = time.time() - t
    t = time.time()
    plan2._block_mask(q.device, causal, (S,) * B)
    t_mask_cached = time.time() - t
    t = time.time()
    docs._make_block_mask(ids, causal, (S,) * B, q.device)
    torch.cuda.synchronize()
    t_mask = time.time() - t
    err = (outs["slices"].float() - outs["flex"].float()).abs().max().item()
    print(
        f"B{B} S{S} hq{hq} hkv{hkv} D{D} causal={causal} docs={n}: plan {t_plan * 1e3:.2f} ms, "
        f"mask {t_mask * 1e3:.2f} ms (cached {t_mask_cached * 1e3:.3f} ms), "
        f"new-plan flex step {t_new_plan * 1e3:.1f} ms | "
        f"slices fwd {res['slices'][1]:.3f} fwd+bwd {res['slices'][2]:.3f} ms | "
        f"flex fwd {res['flex'][1]:.3f} fwd+bwd {res['flex'][2]:.3f} ms "
        f"(first {res['flex'][0]:.1f} s) | max|diff| {err:.3g}",
        flush=True,
    )


for S, ns in ((32768, (1, 2, 4, 8, 16, 64)), (8192, (2, 4))):
    for n in ns:
        run(1, S, 8, 2, 128, n, True)
run(2, 8192, 8, 2, 128, 16, False)
