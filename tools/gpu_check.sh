#!/usr/bin/env bash
# One device call: build with CUDA, run the GPU tests, compute-sanitizer on the kernels,
# and the benchmarks. Prints a short summary last.
# Usage: tools/gpu_check.sh [steps...]; steps: build probe test sanitize native bench attn
# encoder layout (default: build test sanitize bench; `native`: the row kernels under
# compute-sanitizer without XLA, tools/sanitize_rows.cu; `probe`: the wgmma building blocks
# without JAX, tools/probe_wgmma.cu). Environment:
#   PREBUILT=1        skip `build`: use the extension already in jaxsub/ (built elsewhere for
#                     this Python and carried) with PYTHONPATH=$PWD
#   GPU_TESTS="..."   test files for `test` (default: every file, -m gpu)
#   BENCH_ARGS="..."  extra arguments for bench.ops; ATTN_ARGS="..." for bench.attention;
#                     ENCODER_ARGS="..." for bench.encoder; LAYOUT_ARGS="..." for bench.layout
#   SANITIZE_FAMILIES="attention": the families `sanitize` runs, one case per process
#                     (default "attention projected"; the row kernels: `native`)
#   NATIVE_BIN=build/sanitize_rows  `native` runs this prebuilt binary instead of building it
#   NATIVE_TIMEOUT=300  seconds per compute-sanitizer tool in `native`
#   JAXSUB_STAGED_CUDA=1  register the staged CUDA targets (cuda/targets.h) too
set -uo pipefail
steps="${*:-build test sanitize bench}"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
summary=()
has() { [[ " $steps " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [[ "${PREBUILT:-0}" == 1 ]]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
elif has build; then
  t0=$(date +%s)
  JAXSUB_CUDA=ON CMAKE_BUILD_PARALLEL_LEVEL=16 python3 -m pip install -q --no-build-isolation --no-deps -e . \
    >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
  summary+=("build: ok ($(( $(date +%s) - t0 )) s)")
fi
python3 -c "import jaxsub; assert jaxsub.cuda_available(), 'CUDA targets not available'; print('cuda_available True')" || exit 1
python3 -c "from jaxsub import _C; print('attention on wgmma (sm_90a):', _C.attention_sm90())"
if has probe; then
  if nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -Icuda tools/probe_wgmma.cu -o /tmp/probe_wgmma \
      >"$OUT/probe_build.log" 2>&1; then
    /tmp/probe_wgmma 2>&1 | tee "$OUT/probe.log" | tail -9
    summary+=("probe: $(tail -1 "$OUT/probe.log")")
  else
    summary+=("probe: build failed (probe_build.log)")
  fi
fi
if has test; then
  (cd tests && python3 -m pytest -q -m gpu -rf ${GPU_TESTS:-} 2>&1 | tee "$OUT/gpu_tests.log" | tail -25)
  summary+=("gpu tests: $(tail -1 "$OUT/gpu_tests.log")")
fi
if has sanitize; then
  # One case per process, a segfault of the tool itself (rc 139) retried once: run through
  # JAX, compute-sanitizer segfaulted after a few compiled cases in one process, now and then
  # also at start-up or at exit (bench/NOTES.md, forty-second session). memcheck instruments
  # only jaxsub's kernels; racecheck instruments every kernel: with the filter, a program
  # that runs the GEMM target's cuBLASLt kernels uninstrumented failed inside the tool
  # ("failed to handle a hardware exception", then an illegal address; fifty-fourth
  # session), where the whole program is clean. XLA's autotuning is off.
  families="${SANITIZE_FAMILIES:-attention projected}"
  counts=($(python3 tools/sanitize_ops.py --cases $families))
  for tool in memcheck racecheck; do
    ok=0; bad=(); i=0
    for fam in $families; do
      for ((c = 0; c < ${counts[i]}; c++)); do
        for try in 1 2; do
          XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 120 \
            compute-sanitizer --tool $tool $([[ $tool == memcheck ]] && echo --kernel-name kns=jaxsub) \
            python3 -u tools/sanitize_ops.py $fam:$c \
            >"$OUT/sanitize_${tool}_$fam$c.log" 2>&1
          rc=$?; [[ $rc -ne 139 ]] && break
        done
        if [[ $rc -eq 0 ]] && grep -qE '(ERROR|RACECHECK) SUMMARY: 0 ' "$OUT/sanitize_${tool}_$fam$c.log"; then
          ok=$((ok + 1))
        else
          bad+=("$fam:$c(rc=$rc)")
        fi
      done
      i=$((i + 1))
    done
    summary+=("sanitizer $tool: $ok cases clean${bad:+; not clean or not run: ${bad[*]}}")
  done
fi
if has native; then
  # NATIVE_BIN: a tools/sanitize_rows.cu binary built elsewhere (the build takes minutes).
  bin="${NATIVE_BIN:-/tmp/sanitize_rows}"
  INC=$(python3 -c "import jax; print(jax.ffi.include_dir())")
  if [[ -n "${NATIVE_BIN:-}" ]] || nvcc -std=c++17 -O2 -gencode=arch=compute_90,code=sm_90 -I"$INC" -Icuda \
      tools/sanitize_rows.cu -o "$bin" >"$OUT/native_build.log" 2>&1; then
    for tool in memcheck racecheck synccheck initcheck; do
      timeout "${NATIVE_TIMEOUT:-300}" compute-sanitizer --tool $tool "$bin" >"$OUT/native_$tool.log" 2>&1
      summary+=("native $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize_rows' "$OUT/native_$tool.log" | head -3 | tr '\n' ' ')")
    done
  else
    summary+=("native: build failed (native_build.log)")
  fi
fi
if has bench; then
  python3 -m bench.ops --json "$OUT/ops.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_ops.log" | tail -12
fi
if has attn; then
  python3 -m bench.attention --json "$OUT/attention.json" ${ATTN_ARGS:-} 2>&1 | tee "$OUT/bench_attention.log" | tail -30
fi
if has encoder; then
  python3 -m bench.encoder --json "$OUT/encoder.json" ${ENCODER_ARGS:-} 2>&1 | tee "$OUT/bench_encoder.log" | tail -20
fi
if has layout; then
  python3 -m bench.layout --json "$OUT/layout.json" ${LAYOUT_ARGS:-} 2>&1 | tee "$OUT/bench_layout.log" | tail -20
fi
printf '%s\n' "${summary[@]}"
