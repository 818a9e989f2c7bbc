"""The row kernels' launch shapes (cuda/row_config.h: choose_rows) are valid for every
kernel configuration the handlers accept and every row length: row_config_check.cc,
built with the host C++ compiler and run (no GPU needed)."""

import os
import pathlib
import shutil
import subprocess

import jax
import pytest

HERE = pathlib.Path(__file__).resolve().parent


def test_every_kernel_configuration_gives_a_valid_launch(tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    exe = tmp_path / "row_config_check"
    build = subprocess.run([cxx, "-std=c++17", "-O2", "-Wno-return-type", "-I", str(HERE.parent / "cuda"),
                            "-I", jax.ffi.include_dir(), str(HERE / "row_config_check.cc"), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 failures" in run.stdout
