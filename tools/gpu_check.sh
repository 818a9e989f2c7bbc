#!/usr/bin/env bash
# One device call: build with CUDA, run the GPU tests, compute-sanitizer on the kernels,
# and the op benchmark. Prints a short summary last. Usage: tools/gpu_check.sh [steps...]
# steps: build test sanitize bench (default: all).
set -uo pipefail
steps="${*:-build test sanitize bench}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
summary=()
has() { [[ " $steps " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if has build; then
  t0=$(date +%s)
  JAXSUB_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps -e . \
    >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
  summary+=("build: ok ($(( $(date +%s) - t0 )) s)")
  python3 -c "import jaxsub; assert jaxsub.cuda_available(), 'CUDA targets not available'; print('cuda_available True')" || exit 1
fi
if has test; then
  (cd tests && python3 -m pytest -q -m gpu -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -15)
  summary+=("gpu tests: $(tail -1 "$OUT/gpu_tests.log")")
fi
if has sanitize; then
  for tool in memcheck racecheck; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 compute-sanitizer --tool $tool \
      python3 tools/sanitize_ops.py >"$OUT/sanitize_$tool.log" 2>&1
    summary+=("sanitizer $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_ops' "$OUT/sanitize_$tool.log" | tr '\n' ' ')")
  done
fi
if has bench; then
  python3 -m bench.ops --json "$OUT/ops.json" 2>&1 | tee "$OUT/bench_ops.log" | tail -30
fi
printf '%s\n' "${summary[@]}"
