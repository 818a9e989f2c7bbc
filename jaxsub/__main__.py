"""`python -m jaxsub tune ...`: choose an encoder layer's layouts ahead of time.

  python -m jaxsub tune --batch 8 --seq 512 --hidden 1024 --heads 16 --dtype bfloat16

tunes the layer (forward + backward of every candidate of every operator on the GPU, the
shortest path, then the finalists timed again as whole layers: for every option of every
operator the shortest path making it, and the default), stores the result in the cache
that `layouts="auto"` reads
(`EncoderLayer(layouts="auto")` and `jaxsub.optimize` then start without timing), and
prints the chosen path with each stage's time next to the default configuration's.

--mode auto (default) times on a GPU and uses the byte-count heuristic without one;
--mode heuristic never times; --mode timed times on whatever backend there is: on a CPU
that is meant for tiny sizes (e.g. --batch 1 --seq 8 --hidden 32 --heads 2), as a check
that everything runs, and its numbers say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import jax


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxsub", description="jaxsub command-line tools")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tune", help="select an encoder layer's layouts and kernel configurations",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("--batch", type=int, required=True)
    t.add_argument("--seq", type=int, required=True)
    t.add_argument("--hidden", type=int, required=True)
    t.add_argument("--heads", type=int, required=True)
    t.add_argument("--mlp-dim", type=int, default=None, help="feed-forward width (default 4 x hidden)")
    t.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    t.add_argument("--dropout", type=float, default=0.1, help="dropout after projections and GELU")
    t.add_argument("--attention-dropout", type=float, default=0.1)
    t.add_argument("--broadcast-dropout", action="store_true",
                   help="one attention dropout mask [S, S] for every batch element and head (Flax's default)")
    t.add_argument("--pre-layer-norm", action="store_true", help="GPT-style pre-LN layer")
    t.add_argument("--causal", action="store_true")
    t.add_argument("--padding-mask", action="store_true", help="a boolean key-padding mask [B, S]")
    t.add_argument("--mode", default="auto", choices=("auto", "heuristic", "timed"))
    t.add_argument("--budget", type=float, default=900.0,
                   help="seconds of tuning at most (default 900: ahead of time there is no training "
                        "step waiting; layouts='auto' on a first call uses a shorter budget)")
    t.add_argument("--repeats", type=int, default=5, help="timed calls per measurement (median)")
    t.add_argument("--compile-workers", type=int, default=None,
                   help="threads compiling candidates in batches, each batch timed once compiled "
                        "(default: half the cores, at most 8, on a GPU; 0 elsewhere)")
    t.add_argument("--finalists", type=int, default=None,
                   help="after the shortest path, time whole layers: for every option of every stage the "
                        "shortest path making it, and the default; the fastest is chosen. N: at most N "
                        "(default: all, about 30); 0: none (the shortest path as it is)")
    t.add_argument("--cache-dir", type=pathlib.Path, default=None, help="default: $XDG_CACHE_HOME/jaxsub/layouts")
    t.add_argument("--no-cache", action="store_true", help="neither read nor write the cache")
    t.add_argument("--refresh", action="store_true", help="time everything again even if cached")
    t.add_argument("--json", type=pathlib.Path, default=None, help="also write the result here")
    return p


def _fmt(seconds) -> str:
    return "failed" if seconds is None else f"{seconds * 1e6:.4g} us"


def tune_command(args) -> int:
    from jaxsub import layout
    from jaxsub.layout import cache, select, solver, tuning

    try:  # bad sizes, rates or tuning options: a usage error, not a traceback
        spec = layout.LayerSpec(
            batch=args.batch, seq=args.seq, hidden=args.hidden, heads=args.heads,
            mlp_dim=4 * args.hidden if args.mlp_dim is None else args.mlp_dim, dtype=args.dtype, dropout_rate=args.dropout,
            attention_dropout_rate=args.attention_dropout, pre_layer_norm=args.pre_layer_norm, causal=args.causal,
            mask_shape=(args.batch, args.seq) if args.padding_mask else None,
            mask_dtype="bool" if args.padding_mask else None, broadcast_dropout=args.broadcast_dropout)
        options = layout.Auto(budget_s=args.budget,
                              repeats=args.repeats, cache_dir=args.cache_dir, use_cache=not args.no_cache,
                              measure_without_gpu=True, progress=None, refresh=args.refresh,
                              compile_workers=args.compile_workers, finalists=args.finalists)
    except ValueError as e:
        print(f"python -m jaxsub tune: error: {e}", file=sys.stderr)
        return 2
    if args.json is not None and not cache.can_write(args.json):  # before tuning's minutes
        print(f"python -m jaxsub tune: error: cannot write --json {args.json}", file=sys.stderr)
        return 2
    problem = layout.EncoderProblem(spec)
    device = jax.devices()[0]
    print(f"device {device.platform}: {device.device_kind}; jax {jax.__version__}")
    mode = args.mode
    if mode == "auto":
        mode = "timed" if select.gpu_present() else "heuristic"
        if mode == "heuristic":
            print("no GPU: using the byte-count heuristic (--mode timed measures on this backend)")
    elif mode == "timed" and device.platform == "cpu":
        print("note: timing on CPU; the numbers say nothing about a GPU")
    cache_file = None
    if mode == "heuristic":
        tables, source = tuning.model_tables(problem), "heuristic"
    else:
        selection, tables, source, cache_file = select.timed_choice(problem, options)
    if mode == "heuristic":
        selection = tuning.solve(problem, tables, source)
    ordered = [{c.key: t[c.key] for c in st.candidates if c.key in t} for st, t in zip(problem.stages, tables.stages)]
    default_cost = solver.path_cost(ordered, tuning.transpose_cost(tables), [c.key for c in problem.default()])

    print(f"encoder layer: {json.dumps(spec.to_json())}")
    print(selection.describe())
    print(f"default configuration: {_fmt(default_cost)}"
          + (f"; selected / default = {selection.cost_s / default_cost:.3f}" if default_cost else ""))
    default_layer = tables.layers.get(tuple(c.key for c in problem.default()))
    if selection.layer_s is not None and default_layer is not None:
        print(f"timed whole ({len(tables.layers)} finalists): selected {_fmt(selection.layer_s)}, default "
              f"{_fmt(default_layer)}; default / selected = {default_layer / selection.layer_s:.3f}")
    if source != "heuristic":
        print(f"tuning time: {tables.tuning_s:.1f} s ({source})"
              + ("" if tables.complete else "; budget ran out: untimed candidates were left out"))
    if cache_file is not None:
        print(f"cache: {cache_file}")
    failed = {k: v for k, v in tables.errors.items()}
    for (i, key), why in failed.items():
        print(f"  failed: {problem.stages[i].name} {key}: {why}")
    if args.json is not None:
        args.json.write_text(json.dumps({
            "device": f"{device.platform}: {device.device_kind}", "jax_version": jax.__version__,
            "spec": spec.to_json(), "source": source, "selection": selection.to_json(),
            "default_cost_s": default_cost, "default_layer_s": default_layer, "tuning_s": tables.tuning_s,
            "complete": tables.complete,
            "cache_file": str(cache_file) if cache_file else None}, indent=2))
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "tune":
        return tune_command(args)
    return 2  # pragma: no cover - argparse requires a command


if __name__ == "__main__":
    sys.exit(main())
