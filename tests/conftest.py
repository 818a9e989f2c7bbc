"""Test-suite setup: the benchmark harness (`bench/`, not part of the installed package)
is importable from every test module. The repository root is appended, not prepended, so
the installed jaxsub (with its built extension) still wins over the source tree."""

import pathlib
import sys

sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))
