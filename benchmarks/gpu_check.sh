#!/usr/bin/env bash
# The benchmarks' GPU runs, from the repository root on a CUDA machine. Logs and JSON go to $OUT (default
# benchmarks/results/gpu_check). PARTS (comma-separated, run in this order):
#   dist   one MLL value + gradient at n = 200 000 with the multi-GPU path as P = 1 over NCCL against no process
#          group (`benchmarks/distributed.py --device cuda`), then untimed evaluations at 200 000 and 40 000 for the
#          bytes per point on the GPU (max_memory_allocated), by default and as a rank at 10^7 / 8 GPUs runs
#          (`--dense-gib 0 --block-mib 32`); about three minutes, alone on the GPU;
#   mll    one MLL value + gradient at 25 000 (kin40k) and 2 x 10^5, 10^6 (synthetic3d), with the cutoff, every
#          pair, and every pair with the fixed floor of 10 Lanczos steps (the estimator before commit 16cf2ec)
#          (`gpu.py --parts mll`); alone on the GPU, about 2 minutes: the 10^6 every-pair time is the
#          `--gpu-mll-1e6-s` of distributed.py's cost model (its projection to 10^7 on 8 GPUs);
#   kernels  the Triton kernels' products of 17 and of 32 columns at n = 10^4 .. 10^6 (`gpu.py --parts product`),
#          then the same products by BEFORE's package (default 3479e1d: the kernels before commits 9668307..31ea970
#          zero-padded their operands, kept coordinates in registers and took exponentials as ex2) where this copy
#          has the git history to check it out (worktree.log says why not); alone on the GPU, about 4 minutes;
#   speed  the rows of docs/performance.md's GPU table, one after another, alone on the GPU (about 6 minutes):
#          one MLL value + gradient at kin40k n = 25 000 in float64 against GPyTorch's Cholesky and default CG
#          (`gpu.py --parts mll`); the first evaluation in fresh processes (`first_call.py`); BoTorch at
#          n = 10 000 against SingleTaskGP (`bo_compare.py`); one value + gradient at 10^7 points (synthetic3d,
#          float32, with the cutoff; `gpu.py --parts mll --synthetic-sizes 10000000`);
#   late   one value + gradient at 10^6 points at the hyperparameters that end the 50-step fit (l 3.73,
#          outputscale 0.040, noise 0.0078) with AFN ranks 500 and 2000 (`gpu.py --afn-ks`), about 2 minutes;
#   laplace  Laplace GP classification at n = 10^6 (synthetic3d labelled by its median target, Matérn-3/2, float32):
#          `gpnys classify` with the exact kernel (AFN-preconditioned CG on the Triton products with the cutoff,
#          5 Adam steps) and on the Nyström kernel of 1 000 landmarks (`--reduced 1000`, 30 Adam steps on 50 000
#          rows), each with its test accuracy on 2 000 rows; alone on the GPU, a few minutes;
#   boloop the 10-iteration BO loop from 30 000 points (Hartmann-6, q = 1), warm-started against cold
#          (`examples/bo_large_n.py --starts warm,cold --device cuda`), checkpointed after every iteration in
#          $BO_CKPT (default benchmarks/results/bo_warm_cold_n30000_ckpt, inside the copied tree) and copied to
#          $OUT/bo_warm_cold_n30000_ckpt: commit that folder at BO_CKPT and the next call resumes where this one
#          stopped (about 30 minutes in all, so two or three calls); the JSON covers the iterations run so far;
#   fantasy  one-shot qKG value + gradient (16 fantasies x 4 points) at 2 000, 10 000 and 30 000 points,
#          gpnys's fantasy models against SingleTaskGP's where its (f, b, n + 1, n + 1) matrices fit 100 GiB
#          (`bo_fantasy.py --device cuda`); alone on the GPU, a few minutes;
#   multi  one BO iteration with two objectives in one two-output model (`bo_compare.py --outputs 2 --device cuda`)
#          at 5 000 points, against SingleTaskGP (whose posterior broadcasts a 51 GB cache there), then gpnys alone
#          at 30 000 points;
#   suite  the `cuda` test suite (in the background, beside the fit; after `speed`, on its own);
#   fit    the 50-step Adam fit on 10^6 points (`gpu.py --parts fit --fit-1e6`), checkpointed after every step;
#   paths  every other public path at 10^6 (`gpu.py --parts paths`);
#   collect  wait for a fit that an earlier call left running (DETACH=1) and copy its files to $OUT.
# Parts that run together share the GPU, so their wall times are upper bounds. Where the runner hands back only a
# few files, give OUT a folder outside the folder it returns and tar OUT into that folder at the end.
# DETACH=1 starts the fit detached (setsid) under $KEEP (outside the returned folder), so it outlives the call
# while the machine stays up: the call waits until LIMIT seconds, copies what the fit has written so far (JSON,
# log, checkpoint) to $OUT, and a next call made at once with PARTS=collect (then e.g. dist) picks it up. On a fresh
# machine, copy the returned checkpoint into the checkout and rerun with FIT_CKPT=<that path> PARTS=fit: the fit
# resumes at its last step, clock included. FIT_ARGS adds gpu.py arguments (a CPU test: "--device cpu
# --fit-1e6-n 2000 --fit-1e6-steps 4").
#   LIMIT=300 PARTS=mll,suite bash benchmarks/gpu_check.sh              # the MLL rows, then the cuda suite
#   LIMIT=400 PARTS=laplace bash benchmarks/gpu_check.sh                # Laplace classification at 10^6
#   LIMIT=560 PARTS=speed,suite bash benchmarks/gpu_check.sh            # the speed rows, then the cuda suite
#   LIMIT=540 DETACH=1 PARTS=suite,fit bash benchmarks/gpu_check.sh      # call 1
#   LIMIT=200 PARTS=collect,dist bash benchmarks/gpu_check.sh            # call 2, at once
#   LIMIT=560 PARTS=boloop bash benchmarks/gpu_check.sh                 # the BO loop, resumable
#   LIMIT=300 PARTS=fantasy bash benchmarks/gpu_check.sh                # qKG on fantasy models
#   LIMIT=400 PARTS=multi bash benchmarks/gpu_check.sh                  # two objectives, one two-output model
set -u
OUT=${OUT:-benchmarks/results/gpu_check}
LIMIT=${LIMIT:-560}
KEEP=${KEEP:-/tmp/gpnys_keep}
FIT_CKPT=${FIT_CKPT:-$KEEP/fit_1e6.pt}
FIT_ARGS=${FIT_ARGS:-}
PARTS=${PARTS:-suite,fit,paths}
mkdir -p "$OUT" "$KEEP"
export PYTHONPATH=$PWD
python -m pip install --no-deps --no-build-isolation -e . -q > "$KEEP/install.log" 2>&1
export GPNYS_CACHE_DIR=${GPNYS_CACHE_DIR:-$KEEP/gpnys_cache}  # the path costs, calibrated once per machine
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, triton, gpytorch; print('torch', torch.__version__, 'triton', triton.__version__,
  'gpytorch', gpytorch.__version__, 'cpus', __import__('os').cpu_count())"; } > "$OUT/device.txt" 2>&1
left() { echo $(( LIMIT - SECONDS > 1 ? LIMIT - SECONDS : 1 )); }
wait_fit() {  # until the fit wrote its exit status, or the call's LIMIT (a few seconds kept for the copy)
  [ -f "$KEEP/fit_1e6.log" ] || return 0  # no fit was started on this machine
  while [ ! -f "$KEEP/fit_rc" ] && [ "$SECONDS" -lt $(( LIMIT - 5 )) ]; do sleep 2; done
  cp "$KEEP"/gpu_fit_1e6.json "$KEEP"/fit_1e6.log "$FIT_CKPT" "$OUT"/ 2>/dev/null
  [ -f "$KEEP/fit_rc" ] && cp "$KEEP/fit_rc" "$OUT/"
}
case $PARTS in *collect*) wait_fit ;; esac
case $PARTS in *dist*)
  timeout "$(left)" python -u benchmarks/distributed.py --device cuda --procs 1 --n 200000 --dtype float32 \
      --repeats 3 --out "$OUT/distributed_cuda.json" > "$OUT/distributed_cuda.log" 2>&1
  # one process as a rank at 10^7 / 8 GPUs runs: rows checkpointed, passes in blocks (the GPU's 1 GiB blocks hold
  # whole passes at 2 x 10^5, which a rank at 10^7 runs in blocks)
  timeout "$(left)" python -u benchmarks/distributed.py --device cuda --procs '' --n 200000 --dtype float32 \
      --repeats 1 --dense-gib 0 --block-mib 32 --out "$OUT/distributed_cuda_lean.json" > "$OUT/distributed_cuda_lean.log" 2>&1
esac
case $PARTS in *speed*)
  timeout "$(left)" python -u benchmarks/gpu.py --parts mll --real-sizes 25000 --synthetic-sizes '' --dtype float64 \
      --mll-methods gpytorch_cholesky,gpnys,gpytorch_cg --max-seconds 60 --out "$OUT/gpu_mll_25k_float64.json" \
      > "$OUT/mll_25k.log" 2>&1
  timeout "$(left)" python -u benchmarks/first_call.py --device cuda --out "$OUT/first_call.json" \
      > "$OUT/first_call.log" 2>&1
  timeout "$(left)" python -u benchmarks/bo_compare.py --device cuda --n 10000 --singletask-timeout 90 \
      --out "$OUT/bo_compare_n10000.json" > "$OUT/bo_10k.log" 2>&1
  timeout "$(left)" python -u benchmarks/gpu.py --parts mll --real-sizes '' --synthetic-sizes 10000000 \
      --mll-methods gpnys --max-seconds 300 --out "$OUT/gpu_mll_1e7.json" > "$OUT/mll_1e7.log" 2>&1
esac
case $PARTS in *late*)
  timeout "$(left)" python -u benchmarks/gpu.py --parts mll --real-sizes '' --synthetic-sizes 1000000 \
      --mll-methods gpnys --afn-ks 500,2000 --lengthscale 3.73 --outputscale 0.040 --noise 0.0078 \
      --max-seconds 200 --out "$OUT/gpu_mll_1e6_late.json" > "$OUT/mll_1e6_late.log" 2>&1
esac
case $PARTS in *laplace*)
  for extra in "--steps 5" "--steps 30 --reduced 1000 --subsample 50000"; do
    tag=$([ "${extra#*reduced}" != "$extra" ] && echo reduced || echo exact)
    timeout "$(left)" python -u -m gpnys.cli.main classify --data synthetic3d --n 1000000 --n-test 2000 \
        --no-standardize --kernel matern32 --lengthscale 1 --dtype float32 --device cuda $extra --json \
        > "$OUT/classify_1e6_$tag.json" 2> "$OUT/classify_1e6_$tag.log"
  done
esac
case $PARTS in *boloop*)
  BO_CKPT=${BO_CKPT:-benchmarks/results/bo_warm_cold_n30000_ckpt}
  timeout "$(left)" python -u examples/bo_large_n.py --methods gpnys --starts warm,cold --n-init 30000 --iters 10 \
      --seeds 0 --device cuda --checkpoint "$BO_CKPT" --json "$OUT/bo_warm_cold_n30000.json" \
      > "$OUT/bo_loop.log" 2>&1
  # a timeout leaves the checkpoints of the iterations done; the JSON, where the loop finished
  mkdir -p "$OUT/bo_warm_cold_n30000_ckpt" && cp "$BO_CKPT"/*.pt "$OUT/bo_warm_cold_n30000_ckpt/" 2>/dev/null
esac
case $PARTS in *fantasy*)
  timeout "$(left)" python -u benchmarks/bo_fantasy.py --device cuda --sizes 2000,10000,30000 --memory-gib 100 \
      --out "$OUT/bo_fantasy_cuda.json" > "$OUT/bo_fantasy.log" 2>&1
esac
case $PARTS in *multi*)
  timeout "$(left)" python -u benchmarks/bo_compare.py --device cuda --outputs 2 --n 5000 --memory-gib 100 \
      --out "$OUT/bo_compare_n5000_m2_cuda.json" > "$OUT/bo_multi_5000.log" 2>&1
  timeout "$(left)" python -u benchmarks/bo_compare.py --device cuda --outputs 2 --n 30000 --methods gpnys \
      --out "$OUT/bo_compare_n30000_m2_cuda.json" > "$OUT/bo_multi_30000.log" 2>&1
esac
case $PARTS in *mll*)
  timeout "$(left)" python -u benchmarks/gpu.py --parts mll --real-sizes 25000 --synthetic-sizes 200000,1000000 \
      --max-seconds 100 --budget-s 240 --out "$OUT/gpu_mll.json" > "$OUT/mll.log" 2>&1
esac
case $PARTS in *kernels*)
  products() {  # products of 17 and 32 columns by the gpnys package of tree $1 (this tree's gpu.py), tagged $2
    for t in 17 32; do
      name="product_t${t}_$2"
      PYTHONPATH=$1 timeout "$(left)" python -u benchmarks/gpu.py --parts product --product-columns $t --repeats 3 \
          --max-seconds 60 --out "$OUT/gpu_$name.json" > "$OUT/$name.log" 2>&1
    done
  }
  products "$PWD" after
  # the baseline kernels (BEFORE), last: only where this copy has the git history to check them out
  [ -d "$KEEP/before/gpnys" ] ||
      git worktree add --detach -f "$KEEP/before" "${BEFORE:-3479e1d}" > "$OUT/worktree.log" 2>&1
  if [ -d "$KEEP/before/gpnys" ]; then products "$KEEP/before" before; fi
esac
pids=()
case $PARTS in *suite*)
  timeout "$(left)" python -m pytest -m cuda -q -p no:cacheprovider --durations=30 tests > "$OUT/cuda_suite.log" 2>&1 &
  pids+=($!)
esac
case $PARTS in *fit*)
  rm -f "$KEEP/fit_rc"; : > "$KEEP/fit_1e6.log"  # (the log marks a fit as started, for wait_fit)
  budget=$(left); [ -n "${DETACH:-}" ] && budget=3000  # a detached fit outlives this call; the machine's return ends it
  fitcmd="timeout $budget python -u benchmarks/gpu.py --parts fit --fit-1e6 --real-sizes '' --fit-synthetic-sizes '' \
--fit-checkpoint '$FIT_CKPT' --out '$KEEP/gpu_fit_1e6.json' $FIT_ARGS > '$KEEP/fit_1e6.log' 2>&1; echo \$? > '$KEEP/fit_rc'"
  if [ -n "${DETACH:-}" ]; then setsid nohup bash -c "$fitcmd" < /dev/null > /dev/null 2>&1 &
  else bash -c "$fitcmd" & pids+=($!); fi
esac
case $PARTS in *paths*)
  timeout "$(left)" python -u benchmarks/gpu.py --parts paths --out "$OUT/gpu_paths_1e6.json" > "$OUT/paths_1e6.log" 2>&1 &
  pids+=($!)
esac
[ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
case $PARTS in *fit*) wait_fit ;; esac
for f in "$OUT"/*.log "$OUT"/fit_rc; do [ -f "$f" ] && { echo "== $f"; tail -n 4 "$f"; }; done
