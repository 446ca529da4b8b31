"""Shared helpers for the benchmarks: model dirs, result files, the table printed last."""
from __future__ import annotations

import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

# Physical limits on the H200 (../shared/BENCHMARKS.md), output tokens/s.
H200_BW = 4.27e12
LIMITS = {"W1": 285.0, "W2-128-128": 40000.0, "W2-128-2048": 19000.0, "W2-2048-128": 3400.0,
          "W3": 35000.0}


def dummy_model_dir(name: str) -> str:
    """A directory holding only perf/configs/<name>/config.json (load_format='dummy')."""
    d = os.path.join(tempfile.gettempdir(), "pagedbackend-dummy", name)
    os.makedirs(d, exist_ok=True)
    shutil.copy(os.path.join(HERE, "configs", name, "config.json"), os.path.join(d, "config.json"))
    return d


def random_prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` random token ids in [100, 10000) (valid in every model's vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 10000) for _ in range(length)] for _ in range(n)]


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return os.environ.get("PAGEDBACKEND_COMMIT", "unknown")


def gpu_name() -> str:
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def gpu_tag() -> str:
    return gpu_name().replace("NVIDIA ", "").replace(" ", "-").lower()


def write_result(workload: str, model: str, data: dict, suffix: str = "") -> str:
    """perf/results/<workload>-<model>-<gpu>[-<suffix>].json (also under $OUT when remote)."""
    record = {"date": datetime.date.today().isoformat(), "commit": commit(), "gpu": gpu_name(),
              "workload": workload, "model": model, **data}
    name = f"{workload}-{model}-{gpu_tag()}{'-' + suffix if suffix else ''}.json"
    out_dirs = [os.path.join(HERE, "results")]
    if os.environ.get("OUT"):
        out_dirs.append(os.environ["OUT"])
    for d in out_dirs:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "w") as f:
            json.dump(record, f, indent=2)
    return name


def timed(fn, *args, **kwargs):
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def output_tokens(outs) -> int:
    return sum(len(o.token_ids) for r in outs for o in r.outputs)


def print_table(rows: list[dict], title: str) -> None:
    if not rows:
        return
    keys = list(rows[0])
    widths = {k: max(len(k), *(len(_fmt(r.get(k))) for r in rows)) for k in keys}
    print(f"\n== {title} ==")
    print("  ".join(k.ljust(widths[k]) for k in keys))
    for r in rows:
        print("  ".join(_fmt(r.get(k)).ljust(widths[k]) for k in keys))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)
