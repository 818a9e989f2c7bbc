# The README's commands. `make test` and `make bench` set everything up on a fresh machine.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
JAXSUB_CUDA ?= AUTO
export JAXSUB_CUDA

.PHONY: setup dev test test-gpu bench bench-ops bench-layout clean

# Build dependencies first, then the package without build isolation, so the FFI headers
# come from the jaxlib that will load the extension.
setup:
	$(PIP) install -q "scikit-build-core>=0.10" "pybind11>=2.12" "jax>=0.10" "jaxlib>=0.10" "flax>=0.10" numpy pytest "nvidia-cutlass>=3.5"
	$(PIP) install -q --no-build-isolation ".[test]"

# In-place development build (extension copied into jaxsub/; use PYTHONPATH=.).
dev:
	cmake -S . -B build/dev -DJAXSUB_CUDA=$(JAXSUB_CUDA) -DPython_EXECUTABLE=$$(command -v $(PYTHON)) \
	  -Dpybind11_DIR=$$($(PYTHON) -m pybind11 --cmakedir) -DCMAKE_BUILD_TYPE=Release >/dev/null
	cmake --build build/dev -j4
	cp build/dev/_C*.so jaxsub/

test: setup
	cd tests && $(PYTHON) -m pytest -q

test-gpu: setup
	cd tests && $(PYTHON) -m pytest -q -m gpu

# Runs a module of this tree (bench.*) against the installed jaxsub. `python -m` from here
# would import the source tree's jaxsub/ first, which has no built extension on a fresh
# clone: -P keeps this directory off the front of sys.path, and it goes at the end instead,
# where `bench` is still found.
RUN_MODULE = $(PYTHON) -P -c "import runpy, sys; sys.path.append('.'); sys.argv = sys.argv[1:]; \
  runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"

# The main job: the encoder-layer benchmark (bench/encoder.py); a small CPU run without a GPU.
bench: setup
	$(RUN_MODULE) bench

# The fused-op benchmark (bench/ops.py).
bench-ops: setup
	$(RUN_MODULE) bench.ops

# Layout selection on the GPU: selected vs default vs exhaustive search (issue 6).
bench-layout: setup
	$(RUN_MODULE) bench.layout

clean:
	rm -rf build dist *.egg-info jaxsub/_C*.so
