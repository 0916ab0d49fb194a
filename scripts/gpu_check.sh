#!/usr/bin/env bash
# Every GPU check of the project in one run of at most 9 minutes, with one summary table
# (check, backend, result, seconds) at the end.
#
#   scripts/gpu_check.sh [OUTDIR]       (make gpu-check [OUT=dir])
#
# OUTDIR defaults to a new temporary folder (mktemp -d); its path is printed at the start and
# at the end.
#
# Runs from the checkout (PYTHONPATH is set to it; nothing needs installing) with $PYTHON
# (default python3). Three lanes run in parallel, each check with its own timeout, all within
# one budget:
#   lane 1  (a) the unit suite on CUDA: ULYSSES_TEST_DEVICE=cuda pytest -n 8 -m "not dist"
#           tests, 200 s a test (on the last GPU): the tests that start processes would
#           inherit the CUDA switch, and the harness rows run their suites on the GPUs. It
#           starts when the warm-up's recording has ended (below)
#   lane 2  (w) warm_cache: tools/warm_cache.py records the kernel specializations of the
#           harness's cases at the smallest and largest world size and of the public calls
#           at the benchmark shapes (CPU, nothing runs; at most 90 s), then compiles each
#           once, with one process a core (nproc), into the Triton cache the ranks share,
#           until the warm-up's limit (GPU_CHECK_WARM_S, one deadline: the compile step gets
#           whatever the recording left); then (b) the harness at P = 2, 4, 6, 8
#           (dist_tests.validate), every suite, best backend: NCCL when there is a GPU per
#           rank, else gloo on CUDA tensors; the world sizes run at the same time. --large
#           (the GPU-sized and sweep cases) is sized to the machine and to the budget left
#           (GPU_CHECK_LARGE, GPU_CHECK_LARGE_MIN_S, below)
#   lane 3  (l) tools/cuda_layer_check.py on GPU 0: the layer eager, compiled (fullgraph,
#           forward + backward) and captured in a CUDA graph, every attention mode, rank 1
#           of torch's fake group at P = 8 (the one-GPU compiled and captured coverage);
#           (c) dist_tests.compile_check --cuda-graph at P = 2 (NCCL with two GPUs);
#           (d) opcheck (tests/unit/test_ops.py -k opcheck, ULYSSES_TEST_DEVICE=cuda);
#           (e) scripts/gpu_reliability.py (on GPU 0);
#           (f) examples/ulysses_int8_attention.py --device cuda under torchrun at P = 2;
#           (g) examples/ulysses_lowp_attention.py --device cuda under torchrun at P = 2 (the
#           attention step with the low-precision exchange vs the bf16 step, error bound)
# Each check's output goes to OUTDIR/<check>.log (the harness also keeps its JSON summaries
# and per-rank logs under OUTDIR/harness_P<P>/); the table is printed and written to
# OUTDIR/gpu_check_table.md. Every row says what ran: PASS / FAIL / TIMEOUT with what the
# check got through (pytest's closing line, or the tests done of those collected; the
# harness's cases and checks, or the cases done of those selected; the warm-up's
# specializations compiled, failed and not reached) or SKIP with its reason. Exit status 0
# only if no check failed or timed out; a skipped row does not fail the run (nor does a
# warm-up that left specializations to the harness: its row counts them).
#
# Without a GPU the script still runs, to test its plumbing: GPU-only rows are skipped with
# the reason, the others run on CPU (gloo, Triton interpreter), without --large.
#
# The timeline on a cold one-GPU machine (16 cores, the default 540 s). With a 150 s warm-up
# compiling on half the cores and the unit lane started at once, the recorders found 479
# specializations in 59 s beside the unit lane's 8 workers, the pool compiled 208 of them in
# 80 s (2.6 a second), the harness at P = 2 spent 304 s compiling the rest and P = 4 to 8
# were skipped for the budget (warm, afterwards: 73 / 29 / 43 s). Hence:
#   0 s        the recorders (21 processes) and lane 3 (opcheck 116 s, gpu_reliability 66 s,
#              the examples 10 s each); the unit lane waits: it took 288 s from 0 s, so a
#              start ~60 s later still ends well within the budget
#   ~60 s      the compile step on nproc processes: 479 at ~5 a second, ~100 s; the unit
#              lane starts beside it
#   ~160 s     the harness, P = 2, 4, 6, 8 at once, reading their kernels from the cache
#   ~350 s     the unit lane ends, the last of the three
# A warm-up still compiling at 240 s leaves the rest to the harness: its table row counts
# what was compiled and not reached, and the first world size then runs alone (below).
#
# Environment:
#   PYTHON                 interpreter with torch and triton (default python3)
#   GPU_CHECK_BUDGET_S     wall-clock budget of the whole run (default 540 = 9 minutes)
#   GPU_CHECK_QUICK=1      tiny settings, for a CPU machine: a few unit tests, one harness
#                          case per suite and world size
#   GPU_CHECK_WORLD_SIZES  harness world sizes (default "2 4 6 8"; quick: "2")
#   GPU_CHECK_SUITES       harness suites (default: all; e.g. "lowp" to recheck the exchange
#                          only). A run with it set is a partial check: its table says so.
#   GPU_CHECK_LARGE        which world sizes take the harness's --large cases: auto (default:
#                          those with a GPU per rank, and the smallest once the warm-up
#                          compiled everything it recorded), all, none
#   GPU_CHECK_LARGE_MIN_S  --large only if the harness starts with at least this much of the
#                          budget left (default 400 s); else the default cases, and the row
#                          says so. The warm-up does not record the GPU-sized cases, so their
#                          kernels compile in the harness: P = 2 with --large on a cold one-GPU
#                          machine was stopped at 434 s and its lowp suite alone took 213 s.
#                          A cold one-GPU run at the default budget therefore runs the default
#                          cases everywhere (its warm-up ends at ~160 s, leaving less than
#                          400 s); a carried cache (GPU_CHECK_CACHE_IN: the warm-up then only
#                          loads) or a larger budget brings --large in at P = 2
#   GPU_CHECK_WARM_S       the warm-up's limit (default 240 s; 0: no warm-up)
#   GPU_CHECK_CACHE_OUT    a folder: after the run, Triton's compile cache is saved there as
#                          triton_cache.tgz.part00, part01, ... (15 MiB each)
#   GPU_CHECK_CACHE_IN     a folder holding such parts: restored before the run. A cold
#                          one-GPU machine spends most of a check compiling (each harness rank
#                          compiles the same kernels); a check split over two runs on fresh
#                          machines can carry the first run's cache into the second.
set -u -o pipefail

out=${1:-}
if [ -z "$out" ]; then out=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || exit 2; fi
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
quick=${GPU_CHECK_QUICK:-0}
budget=${GPU_CHECK_BUDGET_S:-540}
if [ "$quick" = 1 ]; then world_sizes=${GPU_CHECK_WORLD_SIZES:-2}; else world_sizes=${GPU_CHECK_WORLD_SIZES:-"2 4 6 8"}; fi
large_policy=${GPU_CHECK_LARGE:-auto}
large_min_s=${GPU_CHECK_LARGE_MIN_S:-400}
warm_s=${GPU_CHECK_WARM_S:-240}
warm_record_s=90                # the warm-up's recorders' limit (they took 59 s)
recorded="$out/.warm_recorded"  # made when the warm-up's recording ends (or it did not run)
rm -f "$recorded"
case $large_policy in auto | all | none) ;; *)
    echo "gpu_check: GPU_CHECK_LARGE=$large_policy: expected auto, all or none" >&2
    exit 2
    ;;
esac
start=$(date +%s)
deadline=$((start + budget - 10)) # room for the table
rows="$out/.rows"
rm -rf "$rows" && mkdir -p "$rows"

ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null) || ngpu=0
versions=$("$PY" -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')" 2>&1 | tail -1)
if [ "$ngpu" -gt 0 ]; then
    device=$("$PY" -c "import torch; print(f'{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}')")
else
    device="no GPU ($(nproc) CPU cores)"
fi
if [ -n "${ULYSSES_COMMIT:-}" ]; then  # a copy of the tree without its history
    commit=$ULYSSES_COMMIT
else
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    git diff --quiet HEAD 2>/dev/null || commit="$commit (with local changes)"
fi
if [ -n "${GPU_CHECK_SUITES:-}" ]; then commit="$commit; harness suites: $GPU_CHECK_SUITES only (a partial check)"; fi
echo "gpu_check: $device; $versions; commit $commit; budget ${budget} s; quick=$quick; logs in $out"

tcache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -n "${GPU_CHECK_CACHE_IN:-}" ]; then
    if ls "$GPU_CHECK_CACHE_IN"/triton_cache.tgz.part* >/dev/null 2>&1; then
        mkdir -p "$tcache" && cat "$GPU_CHECK_CACHE_IN"/triton_cache.tgz.part* | tar xzf - -C "$tcache" &&
            echo "gpu_check: Triton cache restored from $GPU_CHECK_CACHE_IN ($(find "$tcache" -type f | wc -l) files in $tcache)"
    else
        echo "gpu_check: GPU_CHECK_CACHE_IN=$GPU_CHECK_CACHE_IN holds no triton_cache.tgz.part*; starting cold"
    fi
fi
# compiled kernels in Triton's cache (a folder each): how many this run had to compile says
# whether a carried cache served (Triton keys a kernel on the first line of every jit function
# it calls, so an edit above one in its file makes every caller compile again)
cache_entries() { if [ -d "$tcache" ]; then find "$tcache" -mindepth 1 -maxdepth 1 -type d | wc -l; else echo 0; fi; }
entries_before=$(cache_entries)

# backend of P ranks: $ULYSSES_BACKEND when set, else the best one here (what "auto" picks)
backend_for() {
    if [ -n "${ULYSSES_BACKEND:-}" ] && [ "$ULYSSES_BACKEND" != auto ]; then
        echo "$ULYSSES_BACKEND"
    elif [ "$ngpu" -ge "$1" ]; then echo nccl; elif [ "$ngpu" -gt 0 ]; then echo gloo-cuda; else echo gloo-cpu; fi
}

# seconds a check may take: its own limit, cut to what is left of the budget
limit_for() {
    local left=$((deadline - $(date +%s)))
    if [ "$1" -lt "$left" ]; then echo "$1"; else echo "$left"; fi
}

# record ORDER CHECK BACKEND RESULT SECONDS: one row of the table
record() { printf '%s|%s|%s|%s\n' "$2" "$3" "$4" "$5" >"$rows/$1"; }

# skip ORDER CHECK BACKEND REASON
skip() {
    record "$1" "$2" "$3" "SKIP: $4" 0
    echo "[gpu_check] $2: SKIP: $4"
}

# run_check ORDER CHECK BACKEND LIMIT_S COMMAND...: run with a timeout, log to OUTDIR/CHECK.log
run_check() {
    local order=$1 name=$2 backend=$3 limit=$4
    shift 4
    if [ "$limit" -lt 15 ]; then
        skip "$order" "$name" "$backend" "no time left in the ${budget} s budget"
        return
    fi
    echo "[gpu_check] start $name (limit ${limit} s): $*"
    local t0 rc result
    t0=$(date +%s)
    {
        echo "\$ $*"
        timeout --kill-after=10 "$limit" "$@"
    } >"$out/$name.log" 2>&1
    rc=$?
    case $rc in
    0) result=PASS ;;
    124 | 137) result="TIMEOUT (${limit} s)" ;;
    *) result="FAIL (rc=$rc)" ;;
    esac
    record "$order" "$name" "$backend" "$result" $(($(date +%s) - t0))
    echo "[gpu_check] $name: $result ($(($(date +%s) - t0)) s)"
}

# The unit suite on CUDA is every test not marked dist (pyproject.toml's markers): the tests
# that start processes would inherit ULYSSES_TEST_DEVICE=cuda (CPU tensors on gloo, launches
# mirrored to one GPU), and what they launch is what the harness rows run. The slow tier's
# sweeps are in (compiled, they are quick).
UNIT_CUDA_MARKERS="not dist"

# The unit lane waits for the warm-up's recording (the recorders are 21 CPU-bound processes;
# beside its 8 workers they took 59 s) and then starts beside the compile step.
wait_for_recording() {
    if [ "$ngpu" -eq 0 ] || [ "$warm_s" -eq 0 ]; then return; fi # no warm-up
    local until=$(($(date +%s) + warm_record_s + 30))
    while [ ! -e "$recorded" ] && [ "$(date +%s)" -lt "$until" ]; do sleep 1; done
    local why="the warm-up's recording has ended"
    if [ ! -e "$recorded" ]; then why="no end of the warm-up's recording seen in $((warm_record_s + 30)) s"; fi
    echo "[gpu_check] the unit lane starts at $(($(date +%s) - start)) s ($why)"
}

lane_unit() {
    wait_for_recording
    if [ "$quick" = 1 ]; then
        run_check 1 unit_tests "cpu (quick: test_grid.py)" "$(limit_for 300)" \
            "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_grid.py
    elif [ "$ngpu" -gt 0 ]; then
        local gpu=$((ngpu - 1))
        echo "[gpu_check] unit_tests_cuda: -m '$UNIT_CUDA_MARKERS' (the tests that start" \
            "processes would inherit ULYSSES_TEST_DEVICE=cuda; the harness rows run their suites)"
        CUDA_VISIBLE_DEVICES=$gpu ULYSSES_TEST_DEVICE=cuda run_check 1 unit_tests_cuda "cuda:$gpu" \
            "$(limit_for 480)" "$PY" -m pytest -n 8 -v -rfEs -p no:cacheprovider --timeout 200 -o timeout_method=thread --durations 25 -m "$UNIT_CUDA_MARKERS" tests
    else
        run_check 1 unit_tests "cpu" "$(limit_for 480)" \
            "$PY" -m pytest -n auto -v -p no:cacheprovider -m "not dist and not slow" tests
    fi
}

# the harness's --large cases at world size P? (GPU_CHECK_LARGE; $2: the smallest world size;
# none when less than GPU_CHECK_LARGE_MIN_S of the budget is left; with auto, none for ranks
# sharing GPUs when the warm-up did not compile everything it recorded (lane_harness's
# $warmed): on a cold cache the GPU-sized cases of one world size compile for longer than the
# whole budget). Why not, when it says no and the policy would have said yes: $large_why.
large_for() {
    large_why=
    if [ "$ngpu" -eq 0 ] || [ "$large_policy" = none ]; then return 1; fi
    if [ "$large_policy" = auto ] && [ "$ngpu" -lt "$1" ] && [ "$1" != "$2" ]; then return 1; fi
    local left
    left=$(limit_for 100000)
    if [ "$left" -lt "$large_min_s" ]; then
        large_why="${left} s of the budget left, --large needs GPU_CHECK_LARGE_MIN_S=${large_min_s} s"
        return 1
    fi
    if [ "$large_policy" = auto ] && [ "${warmed:-1}" = 0 ] && [ "$ngpu" -lt "$1" ]; then
        large_why="ranks sharing a GPU take --large only after a finished warm-up"
        return 1
    fi
    return 0
}

# one world size of the harness: run_check, then put the backend the harness really used
# (from its JSON summary) in the row. The cases it selected go to harness_P<P>/selected.txt
# (the table counts those done when a world size runs out of time).
harness_one() {
    local i=$1 P=$2 limit backend summary dir="$out/harness_P$2"
    shift 2
    limit=$(limit_for 480)
    backend=$(backend_for "$P")
    if [ "$limit" -lt 90 ]; then # no world size of the harness finishes in less
        skip "2$i" "harness_P$P" "$backend" "${limit} s left of the ${budget} s budget (a world size needs more; raise GPU_CHECK_BUDGET_S or run it alone with GPU_CHECK_WORLD_SIZES=$P)"
        return
    fi
    mkdir -p "$dir"
    "$PY" -m ulysses.dist_tests.harness --list "$@" >"$dir/selected.txt" 2>/dev/null
    run_check "2$i" "harness_P$P" "$backend" "$limit" \
        "$PY" -m ulysses.dist_tests.validate --world-sizes "$P" --out-dir "$dir" \
        --timeout-s $((limit - 20)) --outer-timeout-s $((limit - 5)) "$@"
    summary="$dir/ws$P.json"
    if [ -f "$summary" ] && [ -f "$rows/2$i" ]; then
        backend=$("$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['backend'])" "$summary")
        awk -F'|' -v b="$backend" 'BEGIN { OFS = "|" } { $2 = b; print }' "$rows/2$i" >"$rows/.tmp$i" &&
            mv "$rows/.tmp$i" "$rows/2$i"
    fi
}

# The kernels every world size needs, compiled once before the harness starts
# (tools/warm_cache.py): the recorders run on CPU while the unit lane waits, then the compile
# pool takes one process a core, until the warm-up's limit (less 5 s, so warm_cache.py prints
# its summary before the timeout). Without a GPU there is nothing to compile (the interpreter
# runs the kernels).
warm_cache() {
    if [ "$ngpu" -eq 0 ]; then
        skip 20 warm_cache - "no GPU: Triton's interpreter compiles nothing"
        return
    fi
    if [ "$warm_s" -eq 0 ]; then
        skip 20 warm_cache - "GPU_CHECK_WARM_S=0"
        return
    fi
    local limit jobs sizes smallest largest
    limit=$(limit_for "$warm_s")
    jobs=$(nproc)
    smallest=${world_sizes%% *}
    largest=${world_sizes##* }
    sizes=$smallest
    if [ "$largest" != "$smallest" ]; then sizes="$smallest $largest"; fi
    # shellcheck disable=SC2086 # the suite names are words
    run_check 20 warm_cache "cuda ($jobs processes)" "$limit" \
        "$PY" tools/warm_cache.py --jobs "$jobs" --limit-s $((limit - 5)) \
        --record-s "$warm_record_s" --world-sizes "$sizes" --drivers \
        --recorded-file "$recorded" --log "$out/warm_cache_recorders.log" \
        ${GPU_CHECK_SUITES:+--suite $GPU_CHECK_SUITES}
}

# After a finished warm-up (every recorded specialization compiled) every world size runs at
# once and loads its kernels from the cache. Else, with fewer than 32 cores, the first world
# size runs alone and fills the cache, then the others run at once (compilation is CPU bound:
# 20 ranks compiling at once on 16 cores took longer than one world size followed by three).
lane_harness() {
    local i=0 P extra first=1 smallest=${world_sizes%% *} warmed=0 large_why=
    warm_cache
    touch "$recorded" # also when the warm-up was skipped or ended before its recording did
    if [ -f "$rows/20" ] && grep -q '|PASS|' "$rows/20" &&
        grep -q ', 0 not reached,' "$out/warm_cache.log"; then warmed=1; fi
    for P in $world_sizes; do
        i=$((i + 1))
        extra=()
        if large_for "$P" "$smallest"; then
            extra=(--large)
        elif [ -n "$large_why" ]; then
            echo "[gpu_check] harness_P$P: the default cases ($large_why)"
        fi
        if [ "$quick" = 1 ]; then extra+=(--cases "smooth_k/L1-H3-D128,lowp/L1-"); fi
        # shellcheck disable=SC2206 # the suite names are words
        if [ -n "${GPU_CHECK_SUITES:-}" ]; then extra+=(--suite ${GPU_CHECK_SUITES}); fi
        if [ "$first" = 1 ] && [ "$warmed" = 0 ] && [ "$(nproc)" -lt 32 ]; then
            harness_one "$i" "$P" ${extra[@]+"${extra[@]}"}
        else
            harness_one "$i" "$P" ${extra[@]+"${extra[@]}"} &
        fi
        first=0
    done
    wait
}

lane_programs() {
    if [ "$ngpu" -eq 1 ]; then
        skip 31 compile_check_cuda_graph - "one GPU: it needs NCCL with a GPU per rank (gloo \
on CUDA tensors cannot be captured in a CUDA graph, and torch.compile with gloo on CUDA \
crashes in torch); run it on a 2-GPU machine"
    fi
    if [ "$ngpu" -gt 1 ]; then
        run_check 31 compile_check_cuda_graph "$(backend_for 2)" "$(limit_for 150)" \
            "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
            -m ulysses.dist_tests.compile_check --cuda-graph --timeout-s 140
    fi
    if [ "$ngpu" -gt 0 ]; then
        CUDA_VISIBLE_DEVICES=0 run_check 30 layer_compiled_captured cuda:0 "$(limit_for 200)" \
            "$PY" tools/cuda_layer_check.py --out "$out/layer_compiled_captured.md"
        ULYSSES_TEST_DEVICE=cuda run_check 32 opcheck_cuda cuda "$(limit_for 180)" \
            "$PY" -m pytest -v -p no:cacheprovider tests/unit/test_ops.py -k opcheck
        CUDA_VISIBLE_DEVICES=0 run_check 33 gpu_reliability cuda:0 "$(limit_for 150)" \
            "$PY" scripts/gpu_reliability.py
        run_check 34 example_int8_attention "$(backend_for 2)" "$(limit_for 90)" \
            "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
            examples/ulysses_int8_attention.py --device cuda
        run_check 35 example_lowp_attention "$(backend_for 2)" "$(limit_for 90)" \
            "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
            examples/ulysses_lowp_attention.py --device cuda
    else
        skip 30 layer_compiled_captured - "no GPU: tools/cuda_layer_check.py --device cpu runs its compiled rows on CPU"
        skip 31 compile_check_cuda_graph - "no GPU: CUDA graphs need CUDA (the CPU compile path runs in tests/unit/test_ops.py)"
        run_check 32 opcheck cpu "$(limit_for 200)" \
            "$PY" -m pytest -v -p no:cacheprovider tests/unit/test_ops.py -k opcheck
        skip 33 gpu_reliability - "no GPU: the script allocates multi-GB CUDA tensors"
        run_check 34 example_int8_attention gloo-cpu "$(limit_for 200)" \
            "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
            examples/ulysses_int8_attention.py --device cpu
        run_check 35 example_lowp_attention gloo-cpu "$(limit_for 200)" \
            "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
            examples/ulysses_lowp_attention.py --device cpu
    fi
}

lane_unit &
lane_harness &
lane_programs &
wait

"$PY" scripts/gpu_check_table.py "$rows" "$out/gpu_check_table.md" "$device" "$versions" "$commit" "$(($(date +%s) - start))" "$out"
status=$?
entries_after=$(cache_entries)
echo "gpu_check: Triton cache: $entries_before compiled kernels at the start, $entries_after at the" \
    "end ($((entries_after - entries_before)) compiled by this run)"
if [ -n "${GPU_CHECK_CACHE_OUT:-}" ]; then
    if [ -d "$tcache" ]; then
        mkdir -p "$GPU_CHECK_CACHE_OUT" && rm -f "$GPU_CHECK_CACHE_OUT"/triton_cache.tgz.part* &&
            tar czf - -C "$tcache" . | split -b 15m -d - "$GPU_CHECK_CACHE_OUT/triton_cache.tgz.part" &&
            echo "gpu_check: Triton cache saved to $GPU_CHECK_CACHE_OUT: $(cd "$GPU_CHECK_CACHE_OUT" && echo triton_cache.tgz.part*)"
    else
        echo "gpu_check: no Triton cache at $tcache to save"
    fi
fi
echo "gpu_check: logs and the table (gpu_check_table.md) are in $out"
exit $status
