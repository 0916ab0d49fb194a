#!/usr/bin/env bash
# One device call that checks a candidate change and times it (device time is scarce):
#   bash scripts/gpu_explore.sh OUTDIR
# 1. at once: unit tests on CUDA, $UNIT_TESTS (default: the exchange's; last GPU; at most
#    $UNIT_TIMEOUT s, default 200) | a
#    one-GPU script, $SWEEP (default: sweep_tiles.py --kernel pack; GPU 0)
#    (one GPU: the script first, alone, so its cold timings see an idle GPU; then the tests)
# 2. two GPUs: bench_lowp and (unless SKIP_STATS=1) bench_smooth_k_stats --profile-host
#    (NCCL); one GPU: bench_lowp_local (two ranks share it over gloo, local kernels only)
# 3. with the time left (of 540 s): the harness's lowp suite at P = 2 with --large
# Logs in OUTDIR; a short summary on stdout.
set -u
out=${1:?outdir}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
last=$(($(python3 -c "import torch; print(torch.cuda.device_count())") - 1))
unit() {
  CUDA_VISIBLE_DEVICES=$last ULYSSES_TEST_DEVICE=cuda timeout ${UNIT_TIMEOUT:-200} python3 -m pytest -q -n 8 -p no:cacheprovider \
    --timeout 150 -o timeout_method=thread --durations 15 -rfEs ${UNIT_TESTS:-tests/test_lowp_kernels.py tests/test_lowp_attention.py} > "$out/unit_cuda.log" 2>&1
  echo "unit_cuda rc=$? at ${SECONDS}s" >> "$out/unit_cuda.log"
}
sweep() {
  CUDA_VISIBLE_DEVICES=0 timeout ${SWEEP_TIMEOUT:-150} python3 scripts/${SWEEP:-sweep_tiles.py --kernel pack} > "$out/sweep.log" 2>&1
  echo "sweep rc=$? at ${SECONDS}s" >> "$out/sweep.log"
}
if [ "$last" -ge 1 ]; then
  unit & sweep & wait
  timeout 120 python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_lowp.py --out "$out/bench_lowp.csv" > "$out/bench_lowp.log" 2>&1
  echo "bench_lowp rc=$? at ${SECONDS}s" >> "$out/bench_lowp.log"
  if [ -z "${SKIP_STATS:-}" ]; then
    timeout 130 python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_smooth_k_stats.py --profile-host > "$out/bench_stats.log" 2>&1
    echo "bench_smooth_k_stats rc=$? at ${SECONDS}s" >> "$out/bench_stats.log"
  fi
else
  sweep
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_lowp_local.py > "$out/bench_lowp.log" 2>&1
  echo "bench_lowp_local rc=$? at ${SECONDS}s" >> "$out/bench_lowp.log"
  unit
fi
left=$((545 - SECONDS))
if [ "$left" -gt 60 ]; then
  timeout "$left" python3 -m dist_tests.validate --world-sizes 2 --large --suite lowp --out-dir "$out/harness" \
      --timeout-s $((left - 15)) --outer-timeout-s $((left - 5)) > "$out/harness_lowp_P2.log" 2>&1
  echo "harness lowp P2 rc=$? at ${SECONDS}s" >> "$out/harness_lowp_P2.log"
fi
grep -E "passed|failed|FAILED|ERROR|rc=|Timeout|^[0-9.]+s call" "$out/unit_cuda.log" | tail -24
grep -vE "Warn|warn|^\s*$" "$out/sweep.log" | tail -8
grep -vE "Warn|warn|^\s*$|\*\*\*|OMP_NUM" "$out/bench_lowp.log" | tail -46
[ -f "$out/bench_stats.log" ] && grep -E "^\||^# |rc=|Error" "$out/bench_stats.log" | tail -26
[ -f "$out/harness_lowp_P2.log" ] && tail -5 "$out/harness_lowp_P2.log"
cd "$out" && tar czf logs.tgz --exclude=logs.tgz . 2>/dev/null
