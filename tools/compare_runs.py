"""Two runs of the encoder benchmark side by side (any machine).

Reads two JSON files that `python -m bench` wrote (`--json`) and prints, for each
(config, row) in both, the ms per step of each run and the second over the first, then
the GEMM shapes whose algorithm pick (`gemm_tunings`: index in cuBLASLt's heuristic order)
differs between the runs, with the picked candidate's µs in each. The same code measured
~10% apart in two calls of the twenty-ninth session while plain XLA's rows agreed within
2% (bench/NOTES.md); this shows whether the GEMM picks are where it comes from.

Usage: python3 tools/compare_runs.py first.json second.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

_SHAPE = ("dtype", "m", "n", "k", "trans_a", "trans_b", "bias", "c")


def _rows(result: dict) -> dict[tuple[str, str], float | None]:
    return {(r["config"], r["row"]): r.get("ms") for r in result.get("rows", [])}


def _picks(result: dict) -> dict[tuple, tuple[int, list[float]]]:
    return {tuple(t[k] for k in _SHAPE): (t["index"], t["times_us"]) for t in result.get("gemm_tunings", [])}


def _picked_us(pick: tuple[int, list[float]]) -> str:
    index, times = pick
    return f"{times[index]:.1f}" if 0 <= index < len(times) and times[index] >= 0 else "-"


def compare(first: dict, second: dict) -> list[str]:
    """The report's lines for two loaded results."""
    lines = [f"{'config':22s} {'row':9s} {'first ms':>9s} {'second ms':>10s} {'second/first':>13s}"]
    a, b = _rows(first), _rows(second)
    for key in [k for k in a if k in b]:
        x, y = a[key], b[key]
        ratio = f"{y / x:.3f}" if x and y else "-"
        ms = [f"{v:.3f}" if v is not None else "-" for v in (x, y)]
        lines.append(f"{key[0]:22s} {key[1]:9s} {ms[0]:>9s} {ms[1]:>10s} {ratio:>13s}")
    pa, pb = _picks(first), _picks(second)
    common = [k for k in pa if k in pb]
    differ = [k for k in common if pa[k][0] != pb[k][0]]
    lines.append(f"gemm shapes timed in both: {len(common)}; picks that differ: {len(differ)}")
    for k in differ:
        shape = " ".join(f"{name}={value}" for name, value in zip(_SHAPE, k))
        lines.append(f"  {shape}: pick {pa[k][0]} ({_picked_us(pa[k])} us) -> {pb[k][0]} ({_picked_us(pb[k])} us)")
    return lines


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first", type=pathlib.Path)
    p.add_argument("second", type=pathlib.Path)
    args = p.parse_args(argv)
    first, second = (json.loads(path.read_text()) for path in (args.first, args.second))
    print("\n".join(compare(first, second)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
