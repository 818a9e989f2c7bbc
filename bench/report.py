"""Console and JSON conventions shared by the benchmarks: the run header, the copy
bandwidth line, number formatting, the final table, the JSON file, a progress bar and
an optional bar chart."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence

import jax

import jaxsub
from bench import timing
from jaxsub.layout import cache


def fmt(value, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def ratio(a, b):
    return a / b if a is not None and b is not None and b > 0 else None


def reason(e: Exception) -> str:
    """A one-line description of why something did not run."""
    if isinstance(e, NotImplementedError):
        return str(e) or "stub raises NotImplementedError"
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0] if first else ''}".rstrip(": ")


def format_table(header: Sequence[str], lines: Sequence[Sequence[str]], text_columns: int,
                 trailing_text_columns: int = 0) -> str:
    """Pipe-separated table; the first `text_columns` and the last `trailing_text_columns`
    columns are left-aligned, the (numeric) rest right-aligned."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    numeric_end = len(header) - trailing_text_columns

    def join(cells):
        return " | ".join(c.ljust(w) if i < text_columns or i >= numeric_end else c.rjust(w)
                          for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([join(header), "-+-".join("-" * w for w in widths), *(join(line) for line in lines)])


def csv_choices(choices):
    """argparse type: a comma-separated, non-empty subset of `choices`."""
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        unknown = [t for t in items if t not in choices]
        if unknown or not items:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)}; got {text!r}")
        return items
    return parse


def add_run_arguments(p: argparse.ArgumentParser, default_json: pathlib.Path, repeats: int,
                      small_repeats: int) -> None:
    """--repeats, --seed and --json, the same in every benchmark; see `parse_run_args`."""
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed calls per K (median); default {repeats}, {small_repeats} with --small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=pathlib.Path, default=default_json, help=f"output path (default {default_json})")


def has_gpu() -> bool:
    return any(d.platform == "gpu" for d in jax.devices())


def parse_run_args(p: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The parsed arguments, checked; `--small` is set (with a note) where no GPU is
    visible, as the full-size shapes are sized for an H200 and take hours on a CPU (not
    for `--floors`, which times nothing)."""
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    if getattr(args, "json", None) is not None and not cache.can_write(args.json):  # before the run
        p.error(f"cannot write --json {args.json}")
    if not args.small and not getattr(args, "floors", False) and not has_gpu():
        print("no GPU found: running the small CPU configuration (--small)", flush=True)
        args.small = True
    return args


def print_run_header() -> str:
    """Prints what runs where; returns the default backend."""
    backend = jax.default_backend()
    print(f"device {timing.describe_device()}; jax {jax.__version__}; cuda kernels built and visible: "
          f"{jaxsub.cuda_available()}")
    if backend == "cpu":
        print("note: running on CPU; CPU timings say nothing about GPU speed")
    return backend


def measure_copy_bandwidth(buffer_bytes: int, k1: int, k2: int, *, repeats: int, seed: int):
    """`timing.copy_bandwidth`, with the result printed; (bytes/s, SlopeTiming)."""
    bandwidth, copy = timing.copy_bandwidth(buffer_bytes, k1, k2, repeats=repeats, seed=seed)
    if not copy.reliable:
        print("copy bandwidth: slope not positive (noise); using t(K2)/K2, a lower bound on bandwidth")
    print(f"copy bandwidth (read + write, negation of {k2} x {buffer_bytes >> 20} MiB): "
          f"{bandwidth / 1e12:.3f} TB/s", flush=True)
    kernels = timing.copy_bandwidth_kernels(buffer_bytes, k2, seed=seed)
    if kernels:
        print(f"copy bandwidth from the kernels' device time (profiler trace): {kernels / 1e12:.3f} TB/s", flush=True)
    return bandwidth, copy


def run_metadata(backend: str, small: bool, repeats: int) -> dict:
    return {"device": timing.describe_device(), "backend": backend, "jax_version": jax.__version__,
            "small": small, "repeats": repeats}


def write_json(path: pathlib.Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


class Progress:
    """A text progress bar on stderr: redrawn in place on a terminal, one line per step
    otherwise (logs, CI), so long compiles show that the run is alive."""

    def __init__(self, total: int, width: int = 28):
        self.total, self.done, self.width = max(total, 1), 0, width
        self.tty = sys.stderr.isatty()
        self.line = ""

    def update(self, what: str, advance: int = 1) -> None:
        self.done = min(self.done + advance, self.total)
        filled = self.width * self.done // self.total
        self.line = f"[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {what}"
        sys.stderr.write("\r\033[K" + self.line if self.tty else self.line + "\n")
        sys.stderr.flush()

    def note(self, text: str) -> None:
        """Prints a line to stdout without leaving the bar mixed into it."""
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()
        print(text, flush=True)
        if self.tty and self.line:
            sys.stderr.write(self.line)
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()


def bar_chart(path: pathlib.Path, groups: Sequence[str], series: dict[str, Sequence], *, ylabel: str,
              title: str, baseline: float | None = None) -> bool:
    """Grouped bar chart PNG: one group of bars per entry of `groups`, one bar per series
    (None values are left out). matplotlib is optional (the 'bench' extra); without it the
    chart is skipped with a message. Returns whether the file was written."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib not installed; skipping the chart {path} (pip install matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(groups) * max(1, len(series)) / 3), 4.5))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=name)
    if baseline is not None:
        ax.axhline(baseline, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)), groups, rotation=15)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")
    return True
