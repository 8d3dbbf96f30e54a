#!/usr/bin/env bash
# One device call for issue 19 (about 10 minutes on an H100): the `cuda` test suite, the 50-step Adam fit on 10^6
# points and every public path at 10^6 (`gpu.py --parts paths`), side by side on one GPU (so their wall times are
# upper bounds: they share it). Logs and JSON go to $OUT (default benchmarks/results/gpu_check). Usage, on the
# GPU machine from the repository root:   LIMIT=560 bash benchmarks/gpu_check.sh
# The fit saves a checkpoint after every step ($FIT_CKPT, default $OUT/fit_1e6.pt). A call's time limit can stop it
# (each late step takes ~30 s on an H100): copy the returned file into the checkout and rerun with
# FIT_CKPT=<that path> PARTS=fit to resume it where it stopped, clock included.
# PARTS=dist,... first runs issue 22's check alone (about a minute): one MLL value + gradient at n = 200 000 with
# the multi-GPU path as P = 1 over NCCL against no process group (`benchmarks/distributed.py --device cuda`).
set -u
OUT=${OUT:-benchmarks/results/gpu_check}
LIMIT=${LIMIT:-560}
FIT_CKPT=${FIT_CKPT:-$OUT/fit_1e6.pt}
PARTS=${PARTS:-suite,fit,paths}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
pip install --no-deps --no-build-isolation -e . -q > "$OUT/install.log" 2>&1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, triton, gpytorch; print('torch', torch.__version__, 'triton', triton.__version__,
  'gpytorch', gpytorch.__version__, 'cpus', __import__('os').cpu_count())"; } > "$OUT/device.txt" 2>&1
case $PARTS in *dist*)
  timeout "$LIMIT" python -u benchmarks/distributed.py --device cuda --procs 1 --n 200000 --dtype float32 \
      --repeats 3 --out "$OUT/distributed_cuda.json" > "$OUT/distributed_cuda.log" 2>&1
esac
case $PARTS in *suite*)
  timeout "$LIMIT" python -m pytest -m cuda -q -p no:cacheprovider --durations=30 tests > "$OUT/cuda_suite.log" 2>&1 &
esac
case $PARTS in *fit*)
  timeout "$LIMIT" python -u benchmarks/gpu.py --parts fit --fit-1e6 --real-sizes "" --fit-synthetic-sizes "" \
      --fit-checkpoint "$FIT_CKPT" --out "$OUT/gpu_fit_1e6.json" > "$OUT/fit_1e6.log" 2>&1 &
esac
case $PARTS in *paths*)
  timeout "$LIMIT" python -u benchmarks/gpu.py --parts paths --out "$OUT/gpu_paths_1e6.json" > "$OUT/paths_1e6.log" 2>&1 &
esac
wait
[ "$FIT_CKPT" = "$OUT/fit_1e6.pt" ] || cp "$FIT_CKPT" "$OUT/fit_1e6.pt" 2>/dev/null
for f in "$OUT"/*.log; do echo "== $f"; tail -n 3 "$f"; done
