#!/usr/bin/env bash
# Everything this project runs on a lent 2-GPU H200 machine, in one call (device time is
# scarce): correctness first, all in parallel; then the timings, alone on GPU 0.
#   bash scripts/gpu_session.sh OUTDIR
set -u
out=${1:?outdir}
export PYTHONUNBUFFERED=1

export PYTHONPATH=$PWD   # the checkout itself: ulysses/__init__ maps kernels/ to ulysses.kernels
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
last=$((ngpu - 1))
# Phase 1, correctness (timings are not taken here)
(CUDA_VISIBLE_DEVICES=$last ULYSSES_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -n 6 \
    -p no:cacheprovider tests/test_amax.py tests/test_properties.py > "$out/unit_gpu.log" 2>&1;
 echo "unit tests on GPU rc=$?" >> "$out/unit_gpu.log") &
(CUDA_VISIBLE_DEVICES=0 timeout 200 python3 scripts/gpu_smoke.py > "$out/reliability.log" 2>&1;
 CUDA_VISIBLE_DEVICES=0 timeout 150 python3 scripts/gpu_reliability.py >> "$out/reliability.log" 2>&1;
 echo "reliability rc=$?" >> "$out/reliability.log") &
(WORLD_SIZES="2" PYTHON=python3 HARNESS_TIMEOUT_S=150 bash scripts/validate.sh --large > "$out/validate.log" 2>&1;
 WORLD_SIZES="6" PYTHON=python3 HARNESS_TIMEOUT_S=100 bash scripts/validate.sh >> "$out/validate.log" 2>&1;
 echo "validate rc=$?" >> "$out/validate.log") &
wait
tail -3 "$out/unit_gpu.log"; grep -E "PASS|FAIL|sha256|rc=" "$out/reliability.log"; grep -E "^\|| rc=" "$out/validate.log"
# Phase 2, timings
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 scripts/bench_k_grouped_amax.py --out "$out" --compile-max 3 > "$out/bench.log" 2>&1
echo "bench rc=$?"; grep -A30 "^# shape" "$out/bench.log"; grep "PDL chain" "$out/bench.log"
if [ "$ngpu" -ge 2 ]; then
  timeout 60 python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_smooth_k_stats.py --L 32768 --H 32 2>&1 | grep -v Warn | tail -6
fi
