#!/usr/bin/env bash
# Timings on a lent 2-GPU H200 machine in one call (device time is scarce). Logs to OUTDIR.
#   bash scripts/gpu_session.sh OUTDIR [sweep] [unit]
set -u
out=${1:?outdir}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [[ " $* " == *" unit "* ]]; then
(CUDA_VISIBLE_DEVICES=1 ULYSSES_TEST_DEVICE=cuda timeout ${UNIT_TIMEOUT:-360} python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests --ignore=tests/test_dist_harness.py --ignore=tests/test_faults.py > "$out/unit_cuda.log" 2>&1
 echo "unit suite on CUDA rc=$?" >> "$out/unit_cuda.log") &
fi
if [[ " $* " == *" sweep "* ]]; then
  CUDA_VISIBLE_DEVICES=0 timeout 300 python3 scripts/bench_amax.py --sweep > "$out/sweep.log" 2>&1
  echo "sweep rc=$?" >> "$out/sweep.log"
fi
CUDA_VISIBLE_DEVICES=0 PROFILE_HOST=1 timeout 240 python3 scripts/bench_amax.py --csv "$out/bench_amax.csv" > "$out/bench_amax.log" 2>&1
echo "bench_amax rc=$?" >> "$out/bench_amax.log"
wait
timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_smooth_k_stats.py --profile-host > "$out/bench_stats.log" 2>&1
echo "bench_smooth_k_stats rc=$?" >> "$out/bench_stats.log"
[ -f "$out/unit_cuda.log" ] && tail -25 "$out/unit_cuda.log" | grep -E "passed|failed|FAILED|rc=|SKIPPED|Error" | head -20
[ -f "$out/sweep.log" ] && grep -v "^#\|Warn\|warn" "$out/sweep.log" | tail -6
grep -v "^#\|Warn\|warn" "$out/bench_amax.log" | grep -E "^\||host|rc=" | tail -14
grep -E "^\||^#|rc=|Error" "$out/bench_stats.log" | tail -6
