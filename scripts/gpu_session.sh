#!/usr/bin/env bash
# The benchmarks on a lent 2-GPU H200 machine in one call (device time is scarce); logs and CSV
# go to OUTDIR. Correctness is `make gpu-check` (scripts/gpu_check.sh); this is timing only.
#   bash scripts/gpu_session.sh OUTDIR [sweep | sweep-only]
# sweep: first the tile sweeps (pack on GPU 0; qv_stats then amax on the last GPU; at once).
# sweep-only: the sweeps and the host breakdown, no tables.
set -u
out=${1:?outdir}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/scripts
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [[ " $* " == *" sweep "* || " $* " == *" sweep-only "* ]]; then
  last=$((ngpu - 1))
  (CUDA_VISIBLE_DEVICES=0 timeout 300 python3 scripts/sweep_tiles.py --kernel pack > "$out/sweep_pack.log" 2>&1
   echo "sweep_pack rc=$?" >> "$out/sweep_pack.log") &
  (CUDA_VISIBLE_DEVICES=$last timeout 300 python3 scripts/sweep_tiles.py --kernel qv > "$out/sweep_qv.log" 2>&1
   echo "sweep_qv rc=$?" >> "$out/sweep_qv.log"
   CUDA_VISIBLE_DEVICES=$last timeout 300 python3 scripts/bench_amax.py --sweep > "$out/sweep_amax.log" 2>&1
   echo "sweep_amax rc=$?" >> "$out/sweep_amax.log") &
  wait
fi
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 scripts/bench_amax.py --host-parts > "$out/host_parts.log" 2>&1
echo "host_parts rc=$?" >> "$out/host_parts.log"
if [[ " $* " == *" sweep-only "* ]]; then
  for f in sweep_pack sweep_qv sweep_amax host_parts; do grep -vE "Warn|warn|^\s*$" "$out/$f.log" | tail -14; done
  exit 0
fi
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 scripts/bench_amax.py --csv "$out/bench_amax.csv" > "$out/bench_amax.log" 2>&1
echo "bench_amax rc=$?" >> "$out/bench_amax.log"
if [ "$ngpu" -ge 2 ]; then
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_smooth_k_stats.py --profile-host > "$out/bench_stats.log" 2>&1
  echo "bench_smooth_k_stats rc=$?" >> "$out/bench_stats.log"
  timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 scripts/bench_lowp.py --out "$out/bench_lowp.csv" > "$out/bench_lowp.log" 2>&1
  echo "bench_lowp rc=$?" >> "$out/bench_lowp.log"
else
  echo "skipped: bench_smooth_k_stats and bench_lowp need 2 GPUs (NCCL, one GPU per rank); this machine has $ngpu" | tee "$out/bench_stats.log" "$out/bench_lowp.log"
fi
for f in sweep_pack sweep_qv sweep_amax; do
  [ -f "$out/$f.log" ] && grep -vE "Warn|warn|^\s*$" "$out/$f.log" | tail -12
done
grep -E "host part|rc=" "$out/host_parts.log"
grep -E "^\||host|rc=|ceiling" "$out/bench_amax.log" | tail -16
grep -E "^\||^# |rc=|Error" "$out/bench_stats.log" | tail -14
grep -vE "Warn|warn|^\s*$|\*\*\*|OMP_NUM" "$out/bench_lowp.log" | tail -25
