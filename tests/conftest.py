"""Test-suite setup: the benchmark harness (`bench/`, not part of the installed package)
is importable from every test module. The repository root is appended, not prepended, so
the installed jaxsub (with its built extension) still wins over the source tree."""

import os
import pathlib
import shutil
import subprocess
import sys

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import pytest


def pytest_configure(config):
    """The unmarked tests are the CPU suite (CI, the README's test command): they check the
    CPU handlers and the pass's structure at f32 tolerances, where on a GPU backend f32 attention
    falls back to the unfused path, XLA rounds f32 products to TF32 and bf16 products go
    through the GEMM target. So when only they are selected (the default `-m 'not gpu'`) they
    run on the CPU backend on a GPU machine too, unless JAX_PLATFORMS says otherwise; the GPU
    tests (`-m gpu`) run where JAX puts them."""
    if config.getoption("markexpr").strip() == "not gpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture
def fresh_layout(tmp_path, monkeypatch):
    """Never touch the user's real layout cache (XDG_CACHE_HOME under tmp_path); forget
    the selections remembered in this process before and after the test."""
    from jaxsub import layout

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    layout.clear_memo()
    yield
    layout.clear_memo()


@pytest.fixture
def fallback_log(monkeypatch):
    """The (op, reason) of each fallback log line during the test, in order."""
    from jaxsub import _ffi

    calls = []
    monkeypatch.setattr(_ffi, "fallback", lambda op_name, reason, *_, **__: calls.append((op_name, reason)))
    return calls


@pytest.fixture
def host_check(tmp_path):
    """Builds tests/NAME.cc with the host C++ compiler (cuda/ and the XLA FFI headers on the
    include path), runs it and returns its output; a failed build or a non-zero exit fails
    the test. For the header-only checks of CUDA code that also compiles as host code."""
    import jax

    here = pathlib.Path(__file__).resolve().parent

    def run(name: str) -> str:
        cxx = shutil.which(os.environ.get("CXX", "c++"))
        assert cxx is not None, "no C++ compiler (CXX or c++)"
        exe = tmp_path / name
        build = subprocess.run([cxx, "-std=c++17", "-O2", "-Wno-return-type", "-I", str(here.parent / "cuda"),
                                "-I", jax.ffi.include_dir(), str(here / f"{name}.cc"), "-o", str(exe)],
                               capture_output=True, text=True)
        assert build.returncode == 0, build.stderr
        out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    return run


@pytest.fixture
def four_cpu_devices():
    """Runs a Python script in a subprocess with four CPU devices (the device count is fixed
    when JAX starts) and fails the test unless it exits 0 and prints "ok". The subprocess
    imports the jaxsub this test imported (installed, or a development tree's) and can
    import the repository's `examples` and `bench`."""
    import jaxsub

    root = str(pathlib.Path(__file__).resolve().parents[1])

    def run(script: str) -> str:
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
        path = (os.path.dirname(os.path.dirname(jaxsub.__file__)), root, env.get("PYTHONPATH"))
        env["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0 and "ok" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
        return out.stdout

    return run


@pytest.fixture(params=[False, True], ids=["softmax", "softmax_custom_jvp"])
def softmax_flag(request):
    """Both forms of jax.nn.softmax: under jax_softmax_custom_jvp a `custom_jvp_call`,
    matched whole. Found by probing: under the flag, jax.nn.dot_product_attention and
    nnx's attention (a transpose inside the call) and `where=` (the mask an operand of the
    call) were left unfused, the call listed as opaque."""
    import jax

    old = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", request.param)
    yield request.param
    jax.config.update("jax_softmax_custom_jvp", old)
