#!/usr/bin/env bash
# Run the distributed harness at every world size and print one table: `ulysses-validate`
# from this checkout (it runs `python -m ulysses.dist_tests.validate`, which does the work).
#
# Usage:  scripts/validate.sh [--large] [--suite NAME...] [-v] [HARNESS ARGS...]
#   Arguments go to ulysses-validate; those it does not know go to the harness unchanged,
#   e.g. --backend gloo-cpu, --cases L477,used_tail, --seed 3, --list
#   (see `ulysses-validate --help` and `python -m ulysses.dist_tests.harness --help`).
#   It prints a line per world size; -v streams every rank's log as it runs.
#
# Environment:
#   PYTHON              interpreter with torch and ulysses (default: python3)
#   WORLD_SIZES         world sizes to run (default: "2 4 6 8")
#   NPROC               a single world size; overrides WORLD_SIZES (e.g. NPROC=4)
#   HARNESS_TIMEOUT_S   the harness's own wall-clock watchdog per world size (default: 900)
#   VALIDATE_TIMEOUT_S  outer limit per world size (default: HARNESS_TIMEOUT_S + 120)
#   ULYSSES_BACKEND     auto|nccl|gloo-cuda|gloo-cpu, read by the harness (default: auto:
#                       NCCL with a GPU per rank, gloo with shared GPUs, gloo on CPU without)
# Exit status: 0 only if every world size passed.
set -u
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python3}" -m ulysses.dist_tests.validate "$@"
