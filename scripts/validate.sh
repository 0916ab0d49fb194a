#!/usr/bin/env bash
# Run the distributed harness (dist_tests/harness.py, SPEC §5) at every world size, one after
# another, and print one table row per world size. Exit 0 only if every world size passed.
#
# Usage:  scripts/validate.sh [--large] [HARNESS ARGS...]
#   Every argument goes to the harness unchanged, e.g. --large, --backend gloo-cpu,
#   --cases L477,used_tail, --seed 3 (see `python -m dist_tests.harness --help`).
#
# Environment:
#   PYTHON              interpreter with torch and ulysses installed (default: python3)
#   WORLD_SIZES         world sizes to run (default: "2 4 6 8")
#   NPROC               a single world size; overrides WORLD_SIZES (e.g. NPROC=4)
#   HARNESS_TIMEOUT_S   the harness's own wall-clock watchdog, --timeout-s (default: 900)
#   VALIDATE_TIMEOUT_S  outer limit per world size, enforced with `timeout`
#                       (default: HARNESS_TIMEOUT_S + 120)
#   ULYSSES_BACKEND     auto|nccl|gloo-cuda|gloo-cpu, read by the harness (default: auto:
#                       NCCL with a GPU per rank, gloo with shared GPUs, gloo on CPU without)
#
# Each world size P runs
#   $PYTHON -m torch.distributed.run --standalone --nproc-per-node P -m dist_tests.harness \
#       --json FILE --timeout-s HARNESS_TIMEOUT_S [ARGS...]
# --standalone starts a local rendezvous on a free port: no port is ever hard-coded.
#
# Several nodes: this script is single-node; run the harness itself on every node with
#   torchrun --nnodes N --nproc-per-node M --rdzv-backend c10d --rdzv-endpoint HOST:PORT \
#       -m dist_tests.harness [--large] [--json FILE]
# (N*M must be 2, 4, 6 or 8). The harness places each rank on cuda:LOCAL_RANK (or
# LOCAL_RANK % GPUs when ranks share GPUs, judged against LOCAL_WORLD_SIZE) and forms the
# group from RANK / WORLD_SIZE; rank 0 prints the summary and writes FILE.

set -u -o pipefail

cd "$(dirname "$0")/.." || exit 2

PYTHON=${PYTHON:-python3}
WORLD_SIZES=${NPROC:-${WORLD_SIZES:-"2 4 6 8"}}
HARNESS_TIMEOUT_S=${HARNESS_TIMEOUT_S:-900}
VALIDATE_TIMEOUT_S=${VALIDATE_TIMEOUT_S:-$((HARNESS_TIMEOUT_S + 120))}

tmp=$(mktemp -d "${TMPDIR:-/tmp}/ulysses-validate.XXXXXX") || exit 2
trap 'rm -rf "$tmp"' EXIT

results=()
for P in $WORLD_SIZES; do
    json="$tmp/ws$P.json"
    echo "=== world size $P: $PYTHON -m torch.distributed.run --standalone --nproc-per-node $P" \
         "-m dist_tests.harness --json $json --timeout-s $HARNESS_TIMEOUT_S $*"
    start=$(date +%s)
    timeout --kill-after=30 "$VALIDATE_TIMEOUT_S" \
        "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$P" \
        -m dist_tests.harness --json "$json" --timeout-s "$HARNESS_TIMEOUT_S" "$@"
    rc=$?
    results+=("$P $rc $(( $(date +%s) - start ))")
done

"$PYTHON" - "$tmp" "${results[@]}" <<'EOF'
import json
import os
import sys

tmp, rows = sys.argv[1], sys.argv[2:]
header = ["world size", "backend", "device", "cases", "checks", "mismatches", "time (s)",
          "wall (s)", "result"]
table, all_ok = [], True
for row in rows:
    P, rc, wall = row.split()
    path = os.path.join(tmp, f"ws{P}.json")
    summary = None
    if os.path.exists(path):
        with open(path) as f:
            summary = json.load(f)
    ok = rc == "0" and summary is not None and summary.get("passed") is True \
        and summary.get("world_size") == int(P) and summary.get("cases", 0) > 0
    all_ok &= ok
    if ok:
        result = "PASS"
    elif rc in ("124", "137"):
        result = f"TIMEOUT (rc={rc})"
    elif summary is None:
        result = f"FAIL (rc={rc}, no summary)"
    else:
        result = f"FAIL (rc={rc}, errors={summary.get('errors')})"
    if summary is None:
        table.append([P, "-", "-", "-", "-", "-", "-", wall, result])
    else:
        table.append([P, summary["backend"], summary["device"], str(summary["cases"]),
                      str(summary["checks"]), str(summary["mismatches"]),
                      f"{summary['seconds']:.1f}", wall, result])
widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
print()
for r in [header, ["-" * w for w in widths]] + table:
    print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
print()
print("validate: ALL PASSED" if all_ok and table else "validate: FAILED")
sys.exit(0 if all_ok and table else 1)
EOF
