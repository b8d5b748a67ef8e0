#!/usr/bin/env bash
# Builds the extension on a GPU machine from this tree, runs the GPU tests and benchmarks.
#   bench/gpu_check.sh LOG_DIR [WHEEL_DIR] [what: all|build|test|bench]
# WHEEL_DIR holds wheels the machine lacks (nvidia-cudnn-frontend for its C++ headers).
set -uo pipefail
LOG=${1:?log dir}; WHL=${2:-.whl}; WHAT=${3:-all}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
SITE=/tmp/cudnn_jax_site
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHL"/*.whl
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$LOG/gpu.txt" 2>&1

if [ "$WHAT" = all ] || [ "$WHAT" = build ]; then
  start=$(date +%s)
  python3 -m pip install -v --no-build-isolation --no-deps . > "$LOG/build.log" 2>&1 \
    || { tail -60 "$LOG/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
fi
# Run from outside the tree so the installed package (with its extension) is imported.
cd /tmp
python3 -c "import cudnn_jax, cudnn_jax._extension as e; print('extension:', e.module(), e.unavailable_reason())"
if [ "$WHAT" = all ] || [ "$WHAT" = test ]; then
  CUDNN_JAX_SWEEP_LOG=$LOG/sweep.json python3 -m pytest -m gpu -x -q -p no:cacheprovider \
    "$OLDPWD/tests/gpu" 2>&1 | tee "$LOG/pytest_gpu.log" | tail -40
fi
if [ "$WHAT" = all ] || [ "$WHAT" = bench ]; then
  python3 "$OLDPWD/bench/sdpa.py" --out "$LOG" 2>&1 | tee "$LOG/bench.log" | tail -60
fi
