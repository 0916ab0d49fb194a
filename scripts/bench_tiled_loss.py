"""Peak memory and time of the causal-LM loss on one CUDA GPU: the untiled loss (the LM head's
``[B, L, V]`` logits, then ``ulysses.batch.causal_lm_loss``) against
``ulysses.train.tiled_causal_lm_loss`` (chunks of rows through the head and the loss).

    python3 scripts/bench_tiled_loss.py                      (one GPU, P = 1: one rank's rows)
    python3 scripts/bench_tiled_loss.py --rows 32768 --vocab 128256 --hidden 4096 \
        --chunk-rows 4096 8192

Each variant runs forward + backward of the loss alone (``hidden`` [1, L, H] and the head's
weight [V, H] are its inputs, made before the measurement). Printed per variant: the peak
memory the step allocated above its inputs (``torch.cuda.max_memory_allocated`` after
``reset_peak_memory_stats``), the time of one step (the median of ``--repeat``), the loss and
the largest gradient difference against the untiled loss, then a Markdown table with the
device, torch version, date and commit for docs/BENCHMARKS.md. An untiled step that does not
fit is reported as out of memory (the tiled ones still run).
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import time

import torch

import ulysses.batch
import ulysses.train


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _step(kind: str, hidden, weight, labels, chunk_rows: int):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    if kind == "untiled":
        logits = h @ w.T  # [1, L, V] in the input dtype, as an LM head computes it
        loss = ulysses.batch.causal_lm_loss(logits, labels)
    else:
        loss = ulysses.train.tiled_causal_lm_loss(h, w, labels, chunk_rows=chunk_rows)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=32768, help="L, rows per rank")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--chunk-rows", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run (times and values, no memory figures)")  # fmt: skip
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_tiled_loss needs a CUDA GPU (--device cpu: a smoke run)")
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    L, V, H = args.rows, args.vocab, args.hidden
    hidden = torch.randn(1, L, H, device=dev, dtype=dtype, generator=g)
    weight = torch.randn(V, H, device=dev, dtype=dtype, generator=g) * H**-0.5
    labels = torch.randint(0, V, (1, L), device=dev, generator=g)
    labels[0, -1] = ulysses.batch.IGNORE_INDEX
    name = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"{name}, torch {torch.__version__}: L {L}, V {V}, H {H}, {args.dtype}", flush=True)

    rows, ref = [], None
    variants = [("untiled", 0)] + [("tiled", c) for c in args.chunk_rows]
    for kind, chunk in variants:
        label = kind if kind == "untiled" else f"tiled, chunk_rows {chunk}"
        try:
            times = []
            for _ in range(args.repeat):
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                out = _step(kind, hidden, weight, labels, chunk)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                peak = torch.cuda.max_memory_allocated() - base if cuda else 0
                if len(times) < args.repeat:
                    del out
            loss, dh, dw = out
        except torch.OutOfMemoryError:
            if cuda:
                torch.cuda.empty_cache()
            print(f"{label}: out of memory", flush=True)
            rows.append((label, "out of memory", "", "", ""))
            continue
        diff = ""
        if ref is None and kind == "untiled":
            ref = (loss, dh, dw)
        elif ref is not None:
            dg = max(float((a.float() - b.float()).abs().max()) / float(b.float().abs().max())
                     for a, b in ((dh, ref[1]), (dw, ref[2])))  # fmt: skip
            diff = f"{abs(float(loss) - float(ref[0])):.1e} / {dg:.1e}"
        times.sort()
        ms = 1e3 * times[len(times) // 2]
        gib = peak / 2**30
        print(f"{label}: peak {gib:.2f} GiB above the inputs, {ms:.1f} ms, loss "
              f"{float(loss):.6f} {diff}", flush=True)  # fmt: skip
        rows.append((label, f"{gib:.2f}", f"{ms:.1f}", f"{float(loss):.6f}", diff))
        del loss, dh, dw, out

    today = datetime.date.today().isoformat()
    print(f"\n`python3 scripts/bench_tiled_loss.py --rows {L} --vocab {V} --hidden {H}`, "
          f"{name}, torch {torch.__version__}, {today}, commit `{_commit()}`.\n")  # fmt: skip
    print("| loss | peak GiB above inputs | ms (fwd+bwd) | loss value | vs untiled: loss / grad |")
    print("|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    untiled = next((r for r in rows if r[0] == "untiled"), None)
    if cuda and untiled is not None and untiled[1] != "out of memory":
        for r in rows[1:]:
            if r[1] != "out of memory":
                share = float(r[1]) / max(float(untiled[1]), 1e-9)
                print(f"{r[0]}: {100 * share:.1f}% of the untiled loss's peak")


if __name__ == "__main__":
    main()
