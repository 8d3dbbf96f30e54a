#!/usr/bin/env bash
# One device call for issue 19 (about 10 minutes on an H100): the `cuda` test suite, the 50-step Adam fit on 10^6
# points and every public path at 10^6 (`gpu.py --parts paths`), side by side on one GPU (so their wall times are
# upper bounds: they share it). Logs and JSON go to $OUT (default benchmarks/results/gpu_check). Usage, on the
# GPU machine from the repository root:   LIMIT=560 bash benchmarks/gpu_check.sh
set -u
OUT=${OUT:-benchmarks/results/gpu_check}
LIMIT=${LIMIT:-560}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
pip install --no-deps --no-build-isolation -e . -q > "$OUT/install.log" 2>&1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, triton, gpytorch; print('torch', torch.__version__, 'triton', triton.__version__,
  'gpytorch', gpytorch.__version__, 'cpus', __import__('os').cpu_count())"; } > "$OUT/device.txt" 2>&1
timeout "$LIMIT" python -m pytest -m cuda -q -p no:cacheprovider --durations=30 tests > "$OUT/cuda_suite.log" 2>&1 &
timeout "$LIMIT" python -u benchmarks/gpu.py --parts fit --fit-1e6 --real-sizes "" --fit-synthetic-sizes "" \
    --out "$OUT/gpu_fit_1e6.json" > "$OUT/fit_1e6.log" 2>&1 &
timeout "$LIMIT" python -u benchmarks/gpu.py --parts paths --out "$OUT/gpu_paths_1e6.json" > "$OUT/paths_1e6.log" 2>&1 &
wait
tail -3 "$OUT"/*.log
