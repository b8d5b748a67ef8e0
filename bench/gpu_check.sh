#!/usr/bin/env bash
# Builds the extension on a GPU machine from this tree, runs the GPU tests and benchmarks.
#   bench/gpu_check.sh LOG_DIR [WHEEL_DIR] [SWEEP_PROCESSES]
# Environment: BENCHES (default "sdpa"), BENCH_ARGS (or BENCH_ARGS_<name>, e.g.
# BENCH_ARGS_kda="--profile"), SUITE_TIMEOUT (0: skip the portable suite on the GPU),
# SUITE_ARGS, NAMED_TESTS (test paths or node ids in the tree, default tests/gpu),
# SWEEP_TESTS (the files whose random sweeps run, default tests/gpu),
# NAMED_PARALLEL (non-empty: one process per NAMED_TESTS entry, run at once), PACKAGE_WHEEL
# (a cudnn_jax wheel built elsewhere: installed with no CUDA compiler on PATH instead of
# building this tree, so the run tests what `pip install` of that wheel gives), the *_TIMEOUT
# limits below (NAMED_TIMEOUT=0 or SWEEP_TIMEOUT=0 skips), TEST_TIMEOUT (seconds a named
# test may take, default 180). Each named-test process appends a JSON line per test to
# LOG/<name>.jsonl as the test ends (tests/conftest.py), so a process cut short still says
# which tests passed, which failed and why, and which one was running.
# WHEEL_DIR holds wheels the machine lacks (nvidia-cudnn-frontend for its C++ headers);
# .aot/ (carried, git-ignored) the kernel objects from `python kernels/aot.py .aot`.
set -uo pipefail
LOG=${1:?log dir}; WHL=${2:-.whl}; PROCS=${3:-6}
TREE=$(pwd)
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1
SITE=/tmp/cudnn_jax_site
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHL"/*.whl
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$LOG/gpu.txt" 2>&1

start=$(date +%s)
if [ -n "${PACKAGE_WHEEL:-}" ]; then
  # No compiler in reach: only what the wheel carries can serve.
  NO_CUDA_PATH=$(echo "$PATH" | tr : '\n' | grep -v -i cuda | paste -sd:)
  PATH=$NO_CUDA_PATH python3 -m pip install --no-deps --force-reinstall "$PACKAGE_WHEEL" > "$LOG/build.log" 2>&1 \
    || { tail -60 "$LOG/build.log"; exit 1; }
  echo "installed $(basename "$PACKAGE_WHEEL"): $(( $(date +%s) - start )) s; nvcc on its PATH: $(PATH=$NO_CUDA_PATH command -v nvcc || echo none)"
else
  # Ahead-of-time kernels compiled on the build box (python kernels/aot.py .aot): this
  # machine has no CuTe DSL, so the build links those objects.
  [ -f "$TREE/.aot/aot_kernels.h" ] && export CUDNN_JAX_KERNELS_DIR=$TREE/.aot
  # Offline, the build cannot fetch its CUDA compiler from the package index: this machine's
  # toolkit builds (CUDNN_JAX_CUDA_ROOT overrides the build requirements' nvcc).
  export CUDNN_JAX_CUDA_ROOT=${CUDNN_JAX_CUDA_ROOT:-/usr/local/cuda}
  python3 -m pip install -v --no-build-isolation --no-deps . > "$LOG/build.log" 2>&1 \
    || { tail -60 "$LOG/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - start )) s"
fi

NAMED=(); for t in ${NAMED_TESTS:-tests/gpu}; do NAMED+=("$TREE/$t"); done
# From outside the tree, so the installed package (with its extension) is imported.
cd /tmp
named_tests() {  # LOG_NAME TEST...
  local log=$1; shift
  CUDNN_JAX_TEST_RECORDS=$LOG/$log.jsonl CUDNN_JAX_TEST_TIMEOUT=${TEST_TIMEOUT:-180} \
    timeout "${NAMED_TIMEOUT:-600}" python3 -m pytest -q -p no:cacheprovider -rA \
    -k "not random_sweep and not gpu_tier" "$@" > "$LOG/$log.log" 2>&1
  echo "named GPU tests ($log): $(tail -1 "$LOG/$log.log")"
}
if [ "${NAMED_TIMEOUT:-600}" != 0 ]; then
  if [ -n "${NAMED_PARALLEL:-}" ]; then  # one process per entry of NAMED_TESTS, at once
    export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.8 / ${#NAMED[@]}, 3))")
    for i in "${!NAMED[@]}"; do named_tests "pytest_named_$i" "${NAMED[$i]}" & done
    wait
    unset XLA_PYTHON_CLIENT_MEM_FRACTION
  else
    named_tests pytest_named "${NAMED[@]}"
  fi
fi
# The portable suite (pure-JAX engines included) on the GPU backend.
[ "${SUITE_TIMEOUT:-0}" = 0 ] || { timeout "$SUITE_TIMEOUT" python3 -m pytest -q \
  -p no:cacheprovider --ignore "$TREE/tests/gpu" ${SUITE_ARGS:-} "$TREE/tests" \
  > "$LOG/pytest_suite.log" 2>&1; echo "suite on GPU: $(tail -1 "$LOG/pytest_suite.log")"; }
for bench in ${BENCHES-sdpa}; do  # e.g. BENCHES="sdpa kda moe"; BENCHES="" runs none
  per_bench=BENCH_ARGS_$bench
  timeout "${BENCH_TIMEOUT:-240}" python3 "$TREE/bench/$bench.py" --out "$LOG" \
    ${!per_bench:-${BENCH_ARGS:-}} \
    2>&1 | tee "$LOG/bench_$bench.log"
done

# The differential GPU tier (tests/gpu/test_differential_gpu.py), when DIFF_PROCS > 0:
# DIFF_PROCS processes share the GPU, process i checking every DIFF_SHARDS-th configuration
# (default DIFF_PROCS) from the (DIFF_FIRST + i)-th of each op in DIFF_OPS (default all),
# CUDNN_JAX_DIFF_N configurations per op (default 300); a table per op and shard under
# LOG/differential-gpu, a configuration's rows written as it ends.
if [ "${DIFF_PROCS:-0}" -gt 0 ]; then
  DIFF_DIR=$LOG/differential-gpu; mkdir -p "$DIFF_DIR"
  DSHARDS=${DIFF_SHARDS:-$DIFF_PROCS}; DFIRST=${DIFF_FIRST:-0}
  DIFF_TESTS=(); for op in ${DIFF_OPS:-}; do
    DIFF_TESTS+=("$TREE/tests/gpu/test_differential_gpu.py::test_gpu_tier[$op]"); done
  [ ${#DIFF_TESTS[@]} = 0 ] && DIFF_TESTS=("$TREE/tests/gpu/test_differential_gpu.py")
  for i in $(seq "$DFIRST" $((DFIRST + DIFF_PROCS - 1))); do
    XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.8 / $DIFF_PROCS, 3))") \
      CUDNN_JAX_DIFF_DIR=$DIFF_DIR CUDNN_JAX_DIFF_N=${CUDNN_JAX_DIFF_N:-300} \
      CUDNN_JAX_SWEEP_SHARD=$i/$DSHARDS CUDNN_JAX_TEST_RECORDS=$DIFF_DIR/records_$i.jsonl \
      OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 timeout "${DIFF_TIMEOUT:-480}" \
      python3 -m pytest -q -p no:cacheprovider "${DIFF_TESTS[@]}" \
      > "$DIFF_DIR/pytest_$i.log" 2>&1 &
  done
  wait
  python3 - "$DIFF_DIR" <<'PY'
import collections, csv, pathlib, sys
counts = collections.defaultdict(collections.Counter)
configs = collections.defaultdict(set)
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.csv")):
  for row in csv.DictReader(path.open()):
    counts[row["op"]][(row["engine"], row["ok"])] += 1
    configs[row["op"]].add(row["config"])
for op in sorted(counts):
  print(f"differential {op}: {len(configs[op])} configurations;",
        ", ".join(f"{e} {'ok' if ok == 'True' else 'FAILED'} {n}"
                  for (e, ok), n in sorted(counts[op].items())))
PY
fi

[ "${SWEEP_TIMEOUT:-300}" = 0 ] && exit 0
# The sweep, split over processes that share the GPU.
SWEEP=$LOG/sweep  # in LOG, so a run cut short still leaves what it did
mkdir -p "$SWEEP"
export XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.8 / $PROCS, 3))")
# The float64 oracle's BLAS would otherwise start a thread per core in every process.
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1
# Hundreds of distinct programs are compiled once each: no GEMM autotuning at every compile.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0"
# SWEEP_SHARDS (default PROCS) cuts the sweep into that many shards; this run takes PROCS
# of them from SWEEP_FIRST on, so runs on several machines can share one sweep.
SHARDS=${SWEEP_SHARDS:-$PROCS}; FIRST=${SWEEP_FIRST:-0}
SWEEPS=(); for t in ${SWEEP_TESTS:-tests/gpu}; do SWEEPS+=("$TREE/$t"); done
for i in $(seq "$FIRST" $((FIRST + PROCS - 1))); do
  # Autotuning (timing every candidate plan) is what the named tests and the benchmark
  # exercise; the sweep checks numerics, so it keeps the heuristic's choice.
  CUDNN_JAX_AUTOTUNE=0 CUDNN_JAX_SWEEP_SHARD=$i/$SHARDS \
    CUDNN_JAX_TEST_RECORDS=$SWEEP/sweep_$i.jsonl timeout "${SWEEP_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -k random_sweep \
    "${SWEEPS[@]}" > "$SWEEP/sweep_$i.log" 2>&1 &
done
wait
for i in $(seq "$FIRST" $((FIRST + PROCS - 1))); do
  echo "== sweep shard $i: $(tail -1 "$SWEEP/sweep_$i.log")"
done
# One line a configuration, from every shard (also when a shard was cut short).
cat "$SWEEP"/sweep_*.log | grep '^{"config"' > "$LOG/sweep_records.jsonl"
python3 - "$LOG/sweep_records.jsonl" <<'PY'
import collections, json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
status = collections.Counter(r["status"] for r in rows)
print("sweep:", len(rows), "configurations:", dict(status))
for reason, n in collections.Counter(r.get("reason", "")[:150] for r in rows
                                     if r["status"] == "declined").most_common():
  print(f"  declined x{n}: {reason}")
worst = collections.defaultdict(float)
for r in rows:
  for k, v in (r.get("errors") or {}).items():
    worst[k] = max(worst[k], v)
print("  max error:", ", ".join(f"{k} {v:.2e}" for k, v in sorted(worst.items())))
seconds = collections.defaultdict(list)
for r in rows:
  for k, v in (r.get("seconds") or {}).items():
    seconds[k].append(v)
print("  mean seconds per configuration:",
      ", ".join(f"{k} {sum(v) / len(v):.1f}" for k, v in sorted(seconds.items())))
for r in rows:
  if r["status"] == "failed":
    print("  FAILED", r["config"], r.get("problems"))
PY
