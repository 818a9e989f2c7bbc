"""The on-disk cache of tuning results.

One human-readable JSON file per key under `cache_dir()`:
`$XDG_CACHE_HOME/jaxsub/layouts/` (`~/.cache/jaxsub/layouts/` when XDG_CACHE_HOME is
unset or empty), named `<problem>-<hash of the key>.json`. The key holds the GPU (device
kind and platform), the jax and jaxsub versions and the problem (shapes, dtypes, options),
so a new GPU, a new jax or a different shape is a miss. The file holds the key, the
measured tables (every candidate and transpose, so a later jaxsub with more candidates
times only the new ones) and the selection solved from them.

Concurrent writers: a store takes an exclusive lock on `<file>.lock` (POSIX), merges what
is already on disk for the same key (measurements it lacks are kept) and writes a temporary
file in the same directory that `os.replace` moves into place, so a reader never sees a
half-written file, whatever the locking. A file that does not parse, or whose key is not
the one asked for, is ignored with a warning (a miss), and the next store replaces it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import pathlib
import tempfile
import time
import warnings

import jax

FORMAT = 1


def can_write(path: pathlib.Path) -> bool:
    """Whether a file can be written at `path` (its folders made), tried by opening it for
    appending, so that a command that writes its results last learns of a bad path before
    its minutes of work. os.access says yes to root for a path under /proc."""
    path = pathlib.Path(path)
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError:
        return False
    if not existed:
        path.unlink(missing_ok=True)
    return True


def cache_dir(directory=None) -> pathlib.Path:
    """`directory` when given, else the user's cache directory for layout results."""
    if directory is not None:
        return pathlib.Path(directory)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "jaxsub" / "layouts"


def device_key(device=None) -> dict:
    """What identifies the machine a timing is valid for."""
    import jaxsub

    device = device if device is not None else jax.devices()[0]
    return {"device_kind": device.device_kind, "platform": device.platform, "jax": jax.__version__,
            "jaxsub": jaxsub.__version__}


def make_key(problem_key: dict, device: dict | None = None) -> dict:
    """The full cache key: the problem's key and the device key."""
    return {**problem_key, "device": device if device is not None else device_key()}


def _canonical(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def entry_path(key: dict, directory=None) -> pathlib.Path:
    digest = hashlib.sha256(_canonical(key).encode()).hexdigest()[:20]
    name = "".join(c if c.isalnum() or c in "_-" else "_" for c in str(key.get("problem", "layout")))
    return cache_dir(directory) / f"{name}-{digest}.json"


def _read(path: pathlib.Path, key: dict) -> dict | None:
    """The entry at `path` for `key`; None when missing, unreadable or for another key."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:  # UnicodeDecodeError: bytes that are no UTF-8 text
        warnings.warn(f"jaxsub.layout: cannot read cache file {path} ({e}); ignoring it", RuntimeWarning,
                      stacklevel=3)
        return None
    try:
        entry = json.loads(text)
        if not isinstance(entry, dict) or entry.get("format") != FORMAT or not isinstance(entry.get("tables"), dict):
            raise ValueError("not a jaxsub layout cache entry")
        if _canonical(entry.get("key")) != _canonical(key):
            raise ValueError("it holds another key")
        _check_tables(entry["tables"])
    except (ValueError, TypeError, KeyError) as e:
        warnings.warn(f"jaxsub.layout: ignoring corrupt cache file {path} ({e}); it will be rewritten",
                      RuntimeWarning, stacklevel=3)
        return None
    return entry


def _check_tables(tables: dict) -> None:
    """ValueError unless `tables` has the form `tuning.Tables.to_json` writes: each stage a
    name and candidate rows (in, out, config: strings or null), each transpose from/to,
    each whole-layer time a path; every time null, or a number >= 0 (infinity: no edge)."""
    def seconds(row, what):
        t = row["seconds"]
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0):
            raise ValueError(f"{what} time {t!r} is not null or a number >= 0")

    def names(row, fields, what):
        for f in fields:
            if row[f] is not None and not isinstance(row[f], str):
                raise ValueError(f"{what} field {f!r} is {row[f]!r}, not a string")

    for key in ("stages", "transposes", "layers"):
        if not isinstance(tables.get(key, []), list):
            raise ValueError(f"{key!r} is not a list")
    tuning_s = tables.get("tuning_s", 0.0)
    if isinstance(tuning_s, bool) or not isinstance(tuning_s, (int, float)) or not tuning_s >= 0:
        raise ValueError(f"tuning time {tuning_s!r} is not a number >= 0")
    for stage in tables["stages"]:
        if not isinstance(stage["name"], str) or not isinstance(stage["candidates"], list):
            raise ValueError(f"stage {stage!r} has no name or no list of candidates")
        for row in stage["candidates"]:
            names(row, ("in", "out", "config"), "candidate")
            seconds(row, "candidate")
        if stage["candidates"] and all(row["seconds"] == math.inf for row in stage["candidates"]):
            raise ValueError(f"stage {stage['name']!r} has no candidate that ran (every time infinite)")
    for row in tables.get("transposes", []):
        names(row, ("from", "to"), "transpose")
        seconds(row, "transpose")
    for row in tables.get("layers", []):
        path = row["path"]
        if not isinstance(path, list) or not all(
                isinstance(k, list) and len(k) == 3 and all(f is None or isinstance(f, str) for f in k) for k in path):
            raise ValueError(f"whole-layer path {path!r} is not a list of candidate keys [in, out, config]")
        seconds(row, "whole-layer")


def load(key: dict, directory=None) -> dict | None:
    """The cached entry for `key` ({"key", "tables", "selection", ...}) or None."""
    return _read(entry_path(key, directory), key)


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: os.replace alone keeps files whole
        yield
        return
    with open(path.with_suffix(path.suffix + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _merge(old: dict, new: dict) -> dict:
    """Tables `new` plus any measurement only `old` has (stages by name, candidates by
    (in, out, config), transposes by (from, to)); `old`'s whole-layer times only where
    `new` has none."""
    merged = json.loads(json.dumps(new))
    stages = {s["name"]: s for s in merged["stages"]}
    for s in old.get("stages", []):
        mine = stages.get(s["name"])
        if mine is None:
            continue
        have = {(r["in"], r["out"], r["config"]) for r in mine["candidates"]}
        mine["candidates"] += [r for r in s["candidates"] if (r["in"], r["out"], r["config"]) not in have]
    have_t = {(t["from"], t["to"]) for t in merged.get("transposes", [])}
    merged.setdefault("transposes", []).extend(t for t in old.get("transposes", []) if (t["from"], t["to"]) not in have_t)
    # Whole-layer times are comparable only within one measurement: the newer set wins.
    if not merged.get("layers"):
        merged["layers"] = old.get("layers", [])
    return merged


def store(key: dict, tables: dict, selection: dict | None = None, directory=None) -> pathlib.Path:
    """Write the entry for `key` atomically, merged with what is on disk; its path."""
    path = entry_path(key, directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # a corrupt old file is replaced
            old = _read(path, key)
        if old is not None:
            tables = _merge(old["tables"], tables)
        entry = {"format": FORMAT, "key": key, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "selection": selection, "tables": tables}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return path
