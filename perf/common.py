"""Shared helpers for the benchmarks: model dirs, result files, the table printed last."""
from __future__ import annotations

import datetime
import json
import logging
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
# The engine's start-up lines (KV blocks and concurrency, CUDA graphs, the skinny-GEMM choices,
# warnings about mid-run kernel compiles) belong in every benchmark log.
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
logging.getLogger("pagedbackend").setLevel(logging.INFO)

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
    """PAGEDBACKEND_COMMIT when set (a device copy may carry a stale .git), else git's HEAD."""
    if os.environ.get("PAGEDBACKEND_COMMIT"):
        return os.environ["PAGEDBACKEND_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                       text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def gpu_name() -> str:
    import torch
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return "cpu"


def gpu_tag() -> str:
    return gpu_name().replace("NVIDIA ", "").replace(" ", "-").lower()


def engine_overrides() -> dict:
    """PERF_ASYNC=0 / 1 turns async scheduling off / on for an A/B run (unset: engine default)."""
    v = os.environ.get("PERF_ASYNC", "")
    return {} if v == "" else {"async_scheduling": v == "1"}


# A/B switches of a run -> the suffix of its result file: async scheduling off, cuBLAS for every
# matmul (no skinny-GEMM kernel for decode batches of 1-4 rows).
AB_SUFFIXES = {("PERF_ASYNC", "0"): "sync", ("PAGEDBACKEND_SKINNY_GEMM", "0"): "cublas",
               ("PAGEDBACKEND_PDL", "0"): "nopdl", ("PAGEDBACKEND_PREFETCH_MB", "0"): "noprefetch",
               ("PAGEDBACKEND_FP8_FUSED_QUANT", "0"): "fp8nofuse"}


# --ab variants that change the weights' quantization (one at a time)
WEIGHT_VARIANTS = {"fp8w": "fp8", "awq": "awq", "gptq": "gptq", "int8": "int8"}


def result_model(model: str, label: str) -> tuple[str, str]:
    """(model name, suffix) of a variant's result file: quantized weights name the model
    (W1-llama-3.1-8b-awq-h200.json), other switches the suffix."""
    if label in WEIGHT_VARIANTS and label != "fp8w":
        return f"{model}-{label}", ""
    return model, label


AB_HELP = ("comma-separated variants to run after the main one in the same process, "
           "cumulative: noprefetch, pf<MB>, pfplain<MB>, mbt<N>, blaslt, ropekernel, "
           "oldtiles, eagerprefill, decode3, gridorder, fp8kv, fp8n64, fp8w, fp8nofuse, "
           "fp8oldtiles, fp8w8a8, awq, gptq, int8, fp16, pagedkv, nopdl, cublas; default runs the "
           "default again (perf/common.run_variants)")


def run_variants(names: str, make_llm, body) -> None:
    """In-process A/B (same process, so the same skinny-GEMM tile choices): body(llm, label)
    with a fresh engine from make_llm() for "default", then for each comma-separated variant
    in names, cumulative: noprefetch (no weight prefetch into L2 before the PDL wait), pf<MB>
    (that prefetch budget instead of the default), pfplain<MB> (only matmuls without a
    prologue prefetch, that much), mbt<N> (make_llm(max_num_batched_tokens=N)), blaslt
    (torch's matmuls through cuBLASLt: torch.backends.cuda.preferred_blas_library), ropekernel (a
    decode step's rotary + KV write in their own kernel, not in the attention kernel), pagedkv
    (the prefill kernel gathers the step's keys from the cache too: prefill.CONTIG_KV off),
    eagerprefill (no CUDA graphs for single-sequence prefills), oldtiles (the prefill tile
    before the sweep of 2026-12-03: 128 x 64 with 8 warps), decode3 (decode attention with 3
    pipeline stages instead of 2), gridorder (decode attention starts its programs in grid
    order, not the longest sequences first), fp8kv (make_llm(kv_cache_dtype="fp8")), fp8n64
    (an fp8 cache's decode tile of 64 tokens, as bf16's, not decode.FP8_BLOCK_N), fp8w
    (make_llm(quantization="fp8"): the linear layers' weights in e4m3), fp8nofuse (fp8 weights'
    wide matmuls quantize their input in a kernel of their own, not in the RMSNorm / SiLU·mul
    before them: layers/fp8_inputs.FUSED_QUANT off), fp8oldtiles (the skinny matmul's tuner
    without the one-row fp8 tiles that widen e4m3 with integer ops, gemv.FP8_WIDEN_CANDIDATES;
    its choices are forgotten so the next engine tunes again, as after a later "default"),
    fp8w8a8 (fp8 weights' decode steps quantize their input and run the tensor-core FP8 GEMM
    of kernels/fp8_mma.py instead of the W8A16 tiles: fp8_mma.W8A8_DECODE),
    awq / gptq / int8 (make_llm(quantization=...): dummy 4-bit AWQ / GPTQ codes generated on
    the device, or int8 weights; one weight kind at a time, a later one replaces an earlier one
    or fp8w), fp16 (make_llm(dtype="float16"): activations in fp16, as AWQ checkpoints and
    vLLM's AWQ run them),
    nopdl (plain launches), cublas (no skinny GEMM); a pf or mbt replaces an earlier one of its
    kind. Labels such as "noprefetch-nopdl". "default" undoes every switch and runs the
    default again (label "default-again", then "default-again-2", ...): an A-B-A order shows
    whether a later engine in the process runs faster whatever it is (W2 did, by 1-3%, in
    calls 18 and 19). One engine is alive at a time: body must not keep it."""
    import gc

    import torch

    variants = list(filter(None, names.split(",")))

    def kind(v):        # noprefetch is pf0; pfplain<MB> is a pf too
        if v == "noprefetch":
            return "pf"
        if v in WEIGHT_VARIANTS:
            return "weights"
        return next((k for p, k in (("pfplain", "pf"), ("pf", "pf"), ("mbt", "mbt"))
                     if v.startswith(p) and v[len(p):].isdigit()), v)
    for name in variants:
        if kind(name) not in ("nopdl", "cublas", "pf", "mbt", "blaslt", "ropekernel",
                              "eagerprefill", "oldtiles", "decode3", "gridorder", "fp8kv",
                              "fp8n64", "weights", "fp8nofuse", "fp8oldtiles", "pagedkv",
                              "fp8w8a8", "fp16", "default"):
            raise SystemExit(f"--ab {name!r}: must be noprefetch, pf<MB>, pfplain<MB>, "
                             "mbt<N>, blaslt, ropekernel, eagerprefill, oldtiles, "
                             "decode3, gridorder, fp8kv, fp8n64, fp8w, fp8nofuse, fp8oldtiles, "
                             "fp8w8a8, awq, gptq, int8, fp16, pagedkv, nopdl, cublas or "
                             "default")
    steps, active, again = [("default", None)], [], 0
    for v in variants:
        if v == "default":      # later re-runs numbered: labels name the result files
            active, again = [], again + 1
            steps.append(("default-again" + (f"-{again}" if again > 1 else ""), v))
            continue
        active = [a for a in active if kind(a) != kind(v) or kind(v) == v] + [v]
        steps.append(("-".join(active), v))
    switches, initial = (), []
    if variants:    # imported only for an A/B: an older engine (perf/snapshot.sh) may lack them
        from pagedbackend.kernels import common, decode, gemv_tuning, prefill
        from pagedbackend.worker import cuda_graph
        if "fp8nofuse" in variants:     # newer than perf/snapshot.sh's older engines
            from pagedbackend.layers import fp8_inputs
        if "fp8w8a8" in variants:
            from pagedbackend.kernels import fp8_mma
        switches = ((common, "PDL_ENABLED"), (gemv_tuning, "ENABLED"),
                    (decode, "ROPE_IN_DECODE"), (decode, "LONGEST_FIRST"),
                    (cuda_graph, "PREFILL_GRAPHS"), (prefill, "prefill_config"),
                    (decode, "decode_config"), (decode, "FP8_BLOCK_N"),
                    (common, "PREFETCH_BYTES"), (common, "PREFETCH_PLAIN_BYTES"),
                    (prefill, "CONTIG_KV")) \
            + (((fp8_inputs, "FUSED_QUANT"),) if "fp8nofuse" in variants else ()) \
            + (((gemv_tuning, "FP8_WIDEN_CANDIDATES"),) if "fp8oldtiles" in variants else ()) \
            + (((fp8_mma, "W8A8_DECODE"),) if "fp8w8a8" in variants else ())
        initial = [getattr(mod, name) for mod, name in switches]
    blas = torch.backends.cuda.preferred_blas_library()
    overrides = {}
    for label, switch in steps:
        if switch == "default":
            for (mod, name), value in zip(switches, initial):
                setattr(mod, name, value)
            if "fp8oldtiles" in variants:       # tile choices made without the new tiles
                gemv_tuning._CHOICE.clear()
            torch.backends.cuda.preferred_blas_library(blas)
            overrides = {}
        elif switch == "blaslt":
            torch.backends.cuda.preferred_blas_library("cublaslt")
        elif switch == "nopdl":
            common.PDL_ENABLED = False
        elif switch == "cublas":
            gemv_tuning.ENABLED = False
        elif switch == "ropekernel":
            decode.ROPE_IN_DECODE = False
        elif switch == "eagerprefill":
            cuda_graph.PREFILL_GRAPHS = False
        elif switch == "oldtiles":
            new_prefill = prefill.prefill_config
            prefill.prefill_config = lambda d: {**new_prefill(d), **(
                dict(BLOCK_M=128, num_warps=8) if 64 < d <= 128 else {})}
        elif switch == "pagedkv":
            prefill.CONTIG_KV = False
        elif switch == "gridorder":
            decode.LONGEST_FIRST = False
        elif switch == "fp8n64":
            decode.FP8_BLOCK_N = 64
        elif switch == "fp8kv":
            overrides["kv_cache_dtype"] = "fp8"
        elif switch == "fp16":
            overrides["dtype"] = "float16"
        elif switch in WEIGHT_VARIANTS:
            overrides["quantization"] = WEIGHT_VARIANTS[switch]
        elif switch == "fp8nofuse":
            fp8_inputs.FUSED_QUANT = False
        elif switch == "fp8w8a8":
            fp8_mma.W8A8_DECODE = True
        elif switch == "fp8oldtiles":
            gemv_tuning.FP8_WIDEN_CANDIDATES = ()
            gemv_tuning._CHOICE.clear()
        elif switch == "decode3":
            new_decode = decode.decode_config
            decode.decode_config = lambda d, *kv: {**new_decode(d, *kv), "num_stages": 3}
        elif switch == "noprefetch":
            common.PREFETCH_BYTES, common.PREFETCH_PLAIN_BYTES = 0, None
        elif switch is not None and switch.startswith("pfplain"):
            common.PREFETCH_BYTES, common.PREFETCH_PLAIN_BYTES = 0, int(switch[7:]) << 20
        elif switch is not None and kind(switch) == "pf":
            common.PREFETCH_BYTES, common.PREFETCH_PLAIN_BYTES = int(switch[2:]) << 20, None
        elif switch is not None:
            overrides["max_num_batched_tokens"] = int(switch[3:])
        llm = make_llm(**overrides)
        body(llm, label)
        llm.engine.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def write_result(workload: str, model: str, data: dict, suffix: str = "") -> str:
    """perf/results/<workload>-<model>-<gpu>[-<suffix>].json (also under $OUT when remote);
    the A/B switches in AB_SUFFIXES, when set, add their suffix (and are recorded)."""
    record = {"date": datetime.date.today().isoformat(), "commit": commit(), "gpu": gpu_name(),
              "workload": workload, "model": model,
              "async_scheduling": {"0": False, "1": True}.get(os.environ.get("PERF_ASYNC", ""),
                                                              "default"), **data}
    for (var, value), tag in AB_SUFFIXES.items():
        if os.environ.get(var) == value:
            record[var] = value
            suffix = f"{suffix}-{tag}" if suffix else tag
    name = f"{workload}-{model}-{gpu_tag()}{'-' + suffix if suffix else ''}.json"
    out_dirs = [os.path.join(HERE, "results")]
    if os.environ.get("OUT"):
        out_dirs.append(os.environ["OUT"])
    for d in out_dirs:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name), "w") as f:
            json.dump(record, f, indent=2)
    return name


def start_gateway(server, tokenizer: str, key: str, log, *extra: str):
    """The OpenAI gateway in front of a started launcher.TritonServer, on a free port of
    127.0.0.1, serving "smollm2" behind API key `key`; extra: more gateway flags. Returns (its
    process, its base URL) once /health answers 200; RuntimeError if it exits or is not healthy
    within 120 s."""
    import httpx

    from pagedbackend.serving.launcher import free_port
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "client.openai_gateway", "--triton-grpc", server.grpc_url,
         "--host", "127.0.0.1", "--port", str(port), "--tokenizer", tokenizer,
         "--served-model-name", "smollm2", "--api-key", key, "--log-level", "warning", *extra],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(240):
        if proc.poll() is not None:
            raise RuntimeError("the gateway exited at start")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("the gateway did not become healthy")

def cuda_alloc_stats() -> dict:
    """The caching allocator's counters: retries (cache flushed, a device sync) and raw
    cudaMalloc/cudaFree calls since start."""
    import torch
    if not torch.cuda.is_available():
        return {}
    s = torch.cuda.memory_stats()
    return {k: s.get(k, 0) for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}


def timed(fn, *args, **kwargs):
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def timed_greedy(llm, prompts: list, max_tokens: int, warmup_tokens: int = 16,
                 warmup_prompts: int = 1):
    """Greedy, ignore_eos: a short warm-up run of the first prompts, then all prompts timed
    (step timings reset in between). Returns (outputs, seconds)."""
    from pagedbackend import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:warmup_prompts], params.clone(max_tokens=warmup_tokens))
    llm.engine.timing_summary(reset=True)
    return timed(llm.generate, prompts, params)


def decode_tokens_per_s(out, secs: float) -> float:
    """Output tokens after the first, per second after the first token (one request)."""
    return (len(out.outputs[0].token_ids) - 1) / (secs - (out.first_token_time - out.arrival_time))


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


def _kernel_sequence(prof) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every device kernel in the profile, in start order."""
    out = []
    for e in prof.events():
        if "CUDA" in str(e.device_type) and not e.name.startswith(("Memcpy", "Memset")):
            out.append((e.name, e.time_range.start, e.time_range.end - e.time_range.start))
    return sorted(out, key=lambda t: t[1])


def profile_generate(llm, prompts, params, label: str, rows: int = 18, trace: bool = False,
                     cycle: dict[str, int] | None = None) -> dict:
    """One llm.generate under torch.profiler: the top device kernels by total time, and how
    much of the wall time the device was busy. Prints a table; the full table goes under $OUT."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    dev_us = lambda e: getattr(e, "self_device_time_total", None) or e.self_cuda_time_total
    # Kernels (device events), not the CPU ops that launched them (they carry the same time).
    events = [e for e in prof.key_averages() if "CUDA" in str(e.device_type)]
    busy_us = sum(dev_us(e) for e in events)
    events.sort(key=dev_us, reverse=True)
    table = [{"kernel": e.key[:70], "calls": e.count, "total_ms": dev_us(e) / 1e3,
              "share": dev_us(e) / max(busy_us, 1)} for e in events[:rows]]
    print_table(table, f"profile {label}: wall {wall * 1e3:.1f} ms, "
                       f"kernels {busy_us / 1e3:.1f} ms ({busy_us / 1e4 / wall:.0f}% busy)")
    # Host side: CUDA runtime calls by host time (a sync or an allocation shows up here).
    api = sorted((e for e in prof.key_averages() if e.key.startswith("cuda")),
                 key=lambda e: e.self_cpu_time_total, reverse=True)
    print_table([{"runtime_call": e.key[:40], "calls": e.count,
                  "host_ms": e.self_cpu_time_total / 1e3,
                  "max_us": getattr(e, "cpu_time_max", 0.0)} for e in api[:10]],
                f"profile {label}: CUDA runtime calls on the host")
    seq = _kernel_sequence(prof)
    if cycle:
        # kernels that run `k` times per layer in a fixed order (e.g. the skinny matmuls: q|k|v,
        # o, gate|up, down): mean time per position in that order
        rows_c = []
        for name, k in cycle.items():
            durs = [d for n, _, d in seq if n.startswith(name)]
            for i in range(k):
                part = durs[i::k]
                if part:
                    rows_c.append({"kernel": f"{name}[{i}/{k}]", "calls": len(part),
                                   "mean_us": sum(part) / len(part)})
        print_table(rows_c, f"profile {label}: per position in a layer")
    # Device idle time between consecutive kernels (gaps under 50 us, i.e. within a step): what
    # the launches themselves cost. Kernels that overlap (dependent launch) count as 0.
    gaps = [b_start - (a_start + a_dur) for (_, a_start, a_dur), (_, b_start, _)
            in zip(seq, seq[1:])]
    small = [g for g in gaps if g < 50]
    print(f"profile {label}: {len(seq)} kernels, idle between kernels "
          f"{sum(max(g, 0) for g in small) / 1e3:.2f} ms, overlapping pairs "
          f"{sum(g < 0 for g in small)}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], f"profile-{label}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60))
        with open(os.path.join(os.environ["OUT"], f"kernels-{label}.tsv"), "w") as f:
            f.write("kernel\tstart_us\tduration_us\n")     # every kernel, in start order
            f.writelines(f"{n[:120]}\t{s:.3f}\t{d:.3f}\n" for n, s, d in seq)
        if trace:
            prof.export_chrome_trace(os.path.join(os.environ["OUT"], f"trace-{label}.json"))
    return {"wall_ms": wall * 1e3, "kernel_ms": busy_us / 1e3, "busy_fraction": busy_us / 1e6 / wall,
            "top": table[:8]}
