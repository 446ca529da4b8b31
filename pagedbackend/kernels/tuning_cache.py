"""The matmul tuners' choices kept on disk, so that an engine started again on the same GPU
skips the tuning (on an H100 the llama-3.1-8b decode shapes took ~200 s of a W1 engine's start
with 4-bit weights, perf/RESULTS.md calls 83-84).

One JSON file per fingerprint: the GPU's name, torch's, CUDA's and triton's versions and the
bytes of every kernel module (pagedbackend/kernels/*.py), so a changed tile, a changed
candidate list or another GPU never reuses a choice. Each entry is keyed by the tuner's own key
(rows bucket, shape, dtypes, prologue, ...) and the candidate sets it chose from as they are at
the time (an A/B that swaps a candidate list at run time tunes again). Values are tiles
(tuples of ints, bools and strings) or None (the library's kernel).

PAGEDBACKEND_TUNING_CACHE names the folder (default $XDG_CACHE_HOME/pagedbackend/tuning, or
~/.cache/...); "off" (or 0, or empty) keeps every choice in memory only, as before. A file
that cannot be read is ignored with a warning; one that cannot be written costs the next
start its tuning, nothing else. Writes replace the file whole (a temporary file renamed), so
processes that tune at once (tensor-parallel ranks) never leave a torn file; one of them may
drop the other's newest entries, which are then tuned again.
"""
from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Callable

logger = logging.getLogger("pagedbackend")

ENV = "PAGEDBACKEND_TUNING_CACHE"
_KERNELS = Path(__file__).resolve().parent
_LOADED: dict[Path, dict[str, str]] = {}    # file -> its entries, read once per process
_FINGERPRINT: dict[object, str] = {}        # device index -> the file's name
_UNWRITABLE: set[Path] = set()              # files whose write failed (warned once)


def directory() -> Path | None:
    """The cache's folder, or None where PAGEDBACKEND_TUNING_CACHE turns it off."""
    value = os.environ.get(ENV)
    if value is not None:
        if value.strip().lower() in ("", "0", "off", "false", "no", "none"):
            return None
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pagedbackend" / "tuning"


def _device_name(index) -> str:
    import torch
    if index is None or not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(index)


def file_name(device_index) -> str:
    """<GPU name>-<hash of the GPU name, versions and kernel sources>.json"""
    if device_index not in _FINGERPRINT:
        import torch
        import triton
        name = _device_name(device_index)
        h = hashlib.sha256()
        for part in (name, torch.__version__, str(torch.version.cuda), triton.__version__):
            h.update(part.encode() + b"\0")
        for src in sorted(_KERNELS.glob("*.py")):
            h.update(src.name.encode() + b"\0" + src.read_bytes())
        slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
        _FINGERPRINT[device_index] = f"{slug}-{h.hexdigest()[:16]}.json"
    return _FINGERPRINT[device_index]


def _entry_key(table: str, key: tuple, candidates) -> str:
    sets = hashlib.sha256(repr(candidates).encode()).hexdigest()[:16]
    return f"{table} {key!r} {sets}"


_UNREADABLE = (OSError, ValueError, KeyError, TypeError, AttributeError)


def _read(path: Path) -> dict[str, str]:
    """The file's entries; raises FileNotFoundError, or one of _UNREADABLE."""
    return {str(k): str(v) for k, v in json.loads(path.read_text())["entries"].items()}


def _entries(path: Path) -> dict[str, str]:
    if path not in _LOADED:
        entries: dict[str, str] = {}
        try:
            entries = _read(path)
        except FileNotFoundError:
            pass
        except _UNREADABLE as e:
            logger.warning("tuning cache %s is unreadable, ignored (%s)", path, e)
        _LOADED[path] = entries
    return _LOADED[path]


def _write(path: Path, table: str, key: tuple, candidates, value) -> None:
    entries = _entries(path)
    entries[_entry_key(table, key, candidates)] = repr(value)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:        # another process's entries since this one read the file
            entries.update({k: v for k, v in _read(path).items() if k not in entries})
        except _UNREADABLE:
            pass
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"entries": entries}, f, indent=0, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None and os.path.exists(tmp):     # a half-written file, not renamed
            os.unlink(tmp)
        if path not in _UNWRITABLE:     # once a file, not once a shape
            _UNWRITABLE.add(path)
            logger.warning("tuning cache %s not written (%s): the next start tunes again",
                           path, e)


def remembered(table: str, key: tuple, candidates, tune: Callable[[], object]):
    """The choice for key (key[0] the CUDA device index) among `candidates` from the cache
    file, or tune()'s, which is then written there. Without a cache folder: tune()."""
    folder = directory()
    if folder is None:
        return tune()
    path = folder / file_name(key[0])
    stored = _entries(path).get(_entry_key(table, key, candidates))
    if stored is not None:
        try:
            value = ast.literal_eval(stored)
            logger.info("%s %r: %r from the tuning cache %s", table, key, value, path.name)
            return value
        except (ValueError, SyntaxError):
            logger.warning("tuning cache %s: entry for %s %r unreadable, tuned again",
                           path, table, key)
    value = tune()
    _write(path, table, key, candidates, value)
    return value
