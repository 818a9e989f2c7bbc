#!/usr/bin/env bash
# One device call for the pending patches (about 400-550 s). Before it, on this machine:
#   git worktree add /tmp/wt -b pending && (cd /tmp/wt && git am tools/pending/*.patch)
#   build main and /tmp/wt for the device's Python 3.12 (cmake -DJAXSUB_CUDA=ON with
#   -DPython_EXECUTABLE=python3.12), copy the two extensions to build/so/main_C.so and
#   build/so/pending_C.so, and /tmp/wt/tests to build/pending_tests;
# then run this from the repository root with carry build/so/main_C.so,
# build/so/pending_C.so and build/pending_tests.
set -u
export PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
SO=jaxsub/_C.cpython-312-x86_64-linux-gnu.so
use() { cp "build/so/$1_C.so" $SO; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
# The softmax kernels, main against the patches, alternated twice.
for r in 1 2; do for b in main pending; do use $b; timeout 45 python3 tools/time_rows.py $b softmax 2>&1 | grep -v Warning; done; done
# The whole GPU suite on the patched build, four processes.
use pending
t0=$(date +%s)
groups=("test_attention.py"
        "test_attention_packed.py test_attention_projected.py test_mask_grad.py test_softmax.py test_dropout.py"
        "test_gpu_shapes.py test_kernel_config.py test_norm.py test_gelu.py"
        "test_dense.py test_bias.py test_flax.py test_stack.py test_analysis.py")
i=0
for g in "${groups[@]}"; do
  (cd build/pending_tests && XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout ${TEST_LIMIT:-380} python3 -m pytest -q -m gpu -rf \
    -p no:cacheprovider $g > "$OUT/gpu$i.log" 2>&1; echo "rc=$?" >> "$OUT/gpu$i.log") &
  i=$((i+1))
done
wait
echo "tests: $(( $(date +%s) - t0 )) s"
for j in 0 1 2 3; do
  echo "group $j: $(grep -E 'passed|failed|error' "$OUT/gpu$j.log" | tail -1) $(tail -1 "$OUT/gpu$j.log")"
  grep -E "^FAILED|^ERROR" "$OUT/gpu$j.log" | head -10
done
