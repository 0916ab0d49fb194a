"""The table at the end of scripts/gpu_check.sh: one row per check, and in each row what the
check got through, from its log (tests/unit/test_gpu_check_table.py tests it on CPU).

    python scripts/gpu_check_table.py ROWS_DIR TABLE_PATH DEVICE VERSIONS COMMIT WALL_S OUTDIR

ROWS_DIR holds one file per check (``check|backend|result|seconds``, sorted by name); OUTDIR
the checks' logs (``<check>.log``; the harness's summaries and rank logs under
``harness_P<P>/``). Exit status 1 if a check failed or timed out (or none ran).
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys


def read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def pytest_detail(text):
    """pytest's closing line, or (cut off) the tests done of those collected, from -v lines."""
    final = re.findall(
        r"^(?:=+ )?(\d+ (?:passed|failed|skipped|errors?|deselected)[^\n]*?) in [0-9.]+s",
        text,
        re.M,
    )
    if final:
        return final[-1]
    counts = {
        k: len(re.findall(rf"\b{k} tests/", text)) for k in ("PASSED", "FAILED", "ERROR", "SKIPPED")
    }
    total = re.search(r"\[(\d+) items?\]|collected (\d+) items?", text)
    total = next((g for g in total.groups() if g), "?") if total else "?"
    done = sum(counts.values())
    return (
        f"{done} of {total} tests done ({counts['PASSED']} passed, {counts['FAILED']} failed, "
        f"{counts['ERROR']} errors, {counts['SKIPPED']} skipped)"
    )


def harness_detail(name, out):
    """The summary's cases and checks, or (cut off) the cases rank 0 finished of those selected."""
    P = name.removeprefix("harness_P")
    folder = os.path.join(out, name)
    selected = [s for s in read(os.path.join(folder, "selected.txt")).splitlines() if s.strip()]
    command = read(os.path.join(out, name + ".log")).partition("\n")[0]
    mode = "with --large" if " --large" in command else "default cases"
    text = read(os.path.join(folder, f"ws{P}.json"))
    if text:
        s = json.loads(text)
        return (
            f"{s['cases']} cases ({mode}), {s['checks']} checks, {s['mismatches']} "
            f"mismatches, {s['errors']} errors"
        )
    logs = sorted(
        glob.glob(os.path.join(folder, f"ws{P}-logs", "*", "attempt_*", "0", "stdout.log"))
    )
    done = re.findall(r"^\s*\[\s*(\w+)\] (\S+)", read(logs[-1]) if logs else "", re.M)
    failed = sum(1 for status, _ in done if status.lower() not in ("pass", "ok", "skip"))
    last = f"; the last done: {done[-1][1]}" if done else ""
    return f"{len(done)} of {len(selected) or '?'} cases ({mode}) done, {failed} failed{last}"


def detail(name, result, out):
    if result.startswith("SKIP"):
        return ""
    text = read(os.path.join(out, name + ".log"))
    if name.startswith("unit"):
        return pytest_detail(text)
    if name.startswith("harness_P"):
        return harness_detail(name, out)
    if name == "warm_cache":
        return "; ".join(
            l.removeprefix("warm_cache: ")
            for l in text.splitlines()
            if l.startswith("warm_cache: ")
        )
    if name.startswith("opcheck"):
        return pytest_detail(text)
    if name == "layer_compiled_captured":  # its closing line: "cuda_layer_check: N failed"
        rows = [l for l in text.splitlines() if l.startswith("| ") and " | " in l[2:]]
        ran = [r for r in rows if " PASS " in r or " FAIL " in r]
        failed = [r for r in rows if " FAIL " in r]
        return f"{len(ran)} rows ({len(failed)} failed)" + (
            ": " + "; ".join(r.strip("| ")[:80] for r in failed[:3]) if failed else ""
        )
    return ""


def main(argv: list[str]) -> int:
    rows_dir, table_path, device, versions, commit, wall, out = argv
    rows = []
    for name in sorted(os.listdir(rows_dir)):
        with open(os.path.join(rows_dir, name)) as f:
            rows.append(f.read().strip().split("|"))
    text, failed = table(rows, device, versions, commit, wall, out)
    print("\n" + text)
    with open(table_path, "w") as f:
        f.write(text + "\n")
    return 1 if failed or not rows else 0


def table(rows, device, versions, commit, wall, out):
    """(the table's text, the checks that failed or timed out)."""
    rows = [[r[0], r[1], r[2] + (f": {d}" if (d := detail(r[0], r[2], out)) else ""), r[3]]
            for r in rows]  # fmt: skip
    header = ["check", "backend", "result", "seconds"]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(4)]
    lines = [
        f"gpu_check: {device}; {versions}; commit {commit}; {wall} s wall",
        "",
        *(
            "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
            for r in [header, ["-" * w for w in widths]] + rows
        ),
    ]
    failed = [r[0] for r in rows if not (r[2].startswith("PASS") or r[2].startswith("SKIP"))]
    lines += ["", "gpu_check: " + ("FAILED: " + ", ".join(failed) if failed else "ALL PASSED")]
    # what failed or was skipped, from each check's log: pytest's short summary (FAILED / ERROR /
    # SKIPPED lines with their reasons) and the harness's failing cases
    pattern = re.compile(
        r"^(\[default\d+\]:)?(FAILED |ERROR |SKIPPED \[|  \[FAIL\] |harness summary:|.*Error: )"
    )
    for r in rows:
        log = os.path.join(out, r[0] + ".log")
        if not os.path.exists(log) or (
            r[2].startswith("PASS") and not r[0].startswith(("unit", "harness"))
        ):
            continue
        with open(log, errors="replace") as f:
            found = [line.rstrip()[:300] for line in f if pattern.match(line)]
        if found:
            lines += ["", f"{r[0]} ({len(found)} lines from {r[0]}.log):"]
            lines += ["    " + line for line in found[:40]]
            lines += [f"    ... {len(found) - 40} more"] if len(found) > 40 else []
    return "\n".join(lines), failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
