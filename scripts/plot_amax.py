"""Draw the k_grouped_amax table of ``scripts/bench_amax.py`` as read bandwidth per shape.

    python scripts/bench_amax.py | tee amax.txt
    python scripts/plot_amax.py amax.txt docs/bench_h200.png

Reads the printed output (its ``# DEVICE torch ... triton ... commit ... DATE`` and
``# read ceiling ...`` lines and the table at the end) and draws, per shape, the effective read
bandwidth (bytes of K / cold time) of ours (PDL off), torch.compile (default and max-autotune)
and the naive Triton kernel, with the read ceiling of the same run. Needs matplotlib, which
the package does not depend on (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import re
import sys

DTYPES = {"bfloat16": "bf16", "float16": "fp16"}


def parse(text: str) -> tuple[str, float, list[dict]]:
    """(title line, read ceiling in TB/s, rows) from bench_amax.py's output."""
    title = next(line[2:].strip() for line in text.splitlines() if " triton " in line)
    # the commit bench_amax.py prints is the checkout's HEAD, which a copied tree may not
    # carry: the plot names the device, versions and date only
    title = re.sub(r" commit \S+", "", title)
    ceiling = float(re.search(r"read ceiling .*?: ([0-9.]+) TB/s", text).group(1))
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.match(r"B(\d+) L(\d+) H(\d+) D(\d+) P(\d+) r(\d+) G(\d+) (\w+)$", cells[0])
        if not line.startswith("|") or m is None:
            continue
        B, L, H, D = (int(m.group(i)) for i in range(1, 5))
        compiled = [float(x.rstrip("*")) for x in cells[5].split("/")]
        dtype = DTYPES.get(m.group(8), m.group(8))
        rows.append(
            {
                "label": f"B{B} L{L}\nH{H} D{D}\nG{m.group(7)} {dtype}",
                "bytes": B * L * H * D * 2,
                "ours": float(cells[3]),
                "compile default": compiled[0],
                "compile max-autotune": compiled[1],
                "naive Triton": float(cells[6].rstrip("*")),
            }
        )
    if not rows:
        raise SystemExit("plot_amax: no table rows found; pass bench_amax.py's output")
    return title, ceiling, rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("table", help="bench_amax.py's printed output")
    ap.add_argument("png")
    args = ap.parse_args()
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot_amax: needs matplotlib (pip install matplotlib)")
    with open(args.table) as f:
        title, ceiling, rows = parse(f.read())
    rows.sort(key=lambda r: r["bytes"])
    providers = {
        "ours": ("ours (PDL off)", "#1f77b4"),
        "compile default": ("torch.compile, default", "#ff7f0e"),
        "compile max-autotune": ("torch.compile, max-autotune", "#ffbb78"),
        "naive Triton": ("naive Triton kernel", "#7f7f7f"),
    }
    width = 0.8 / len(providers)
    fig, ax = plt.subplots(figsize=(11, 4.8))
    for i, (name, (label, color)) in enumerate(providers.items()):
        xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(rows))]
        tbs = [r["bytes"] / (r[name] * 1e-6) / 1e12 for r in rows]
        ax.bar(xs, tbs, width, label=label, color=color)
    ax.axhline(
        ceiling,
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"read ceiling, {ceiling:.2f} TB/s (torch.sum, cold)",
    )
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['label']}\n{r['bytes'] / 1e6:.0f} MB" for r in rows], fontsize=7)
    ax.set_ylabel("TB/s read (bytes of K / cold time)")
    ax.set_ylim(0, ceiling * 1.3)
    ax.set_title(f"k_grouped_amax, cold (L2 flushed), one rank's shard\n{title}", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", ncol=3)
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"plot_amax: wrote {args.png}")


if __name__ == "__main__":
    main()
