"""perf/common.run_variants: the in-process A/B driver sets each variant's switches, keeps
earlier ones (cumulative), and "default" restores the start state (A-B-A runs)."""
import pytest

pytest.importorskip("triton")


class FakeLLM:
    def __init__(self, **overrides):
        self.overrides = overrides
        self.engine = self
        self.stopped = False

    def shutdown(self):
        self.stopped = True


def test_variants_are_cumulative_and_default_restores_everything(perf_module):
    from pagedbackend.kernels import common, decode, prefill
    from pagedbackend.worker import cuda_graph
    perf = perf_module("common")
    start = (common.PDL_ENABLED, decode.ROPE_IN_DECODE, cuda_graph.PREFILL_GRAPHS,
             prefill.prefill_config, common.PREFETCH_BYTES)
    seen, engines = [], []

    def make_llm(**kw):
        engines.append(FakeLLM(**kw))
        return engines[-1]

    def body(llm, label):
        assert not any(e is not llm and not e.stopped for e in engines)   # one alive at a time
        seen.append((label, common.PDL_ENABLED, decode.ROPE_IN_DECODE,
                     prefill.prefill_config(128)["BLOCK_M"], common.PREFETCH_BYTES,
                     llm.overrides.get("max_num_batched_tokens")))
    try:
        perf.run_variants("ropekernel,pf4,mbt2048,default,nopdl", make_llm, body)
    finally:
        (common.PDL_ENABLED, decode.ROPE_IN_DECODE, cuda_graph.PREFILL_GRAPHS,
         prefill.prefill_config, common.PREFETCH_BYTES) = start
    block_m = prefill.prefill_config(128)["BLOCK_M"]
    pdl, rope, pf = start[0], start[1], start[4]
    assert seen == [
        ("default", pdl, rope, block_m, pf, None),
        ("ropekernel", pdl, False, block_m, pf, None),
        ("ropekernel-pf4", pdl, False, block_m, 4 << 20, None),
        ("ropekernel-pf4-mbt2048", pdl, False, block_m, 4 << 20, 2048),
        ("default-again", pdl, rope, block_m, pf, None),
        ("nopdl", False, rope, block_m, pf, None),
    ]
    assert all(e.stopped for e in engines)


def test_blaslt_variant_prefers_cublaslt_and_default_restores_the_library(perf_module,
                                                                         monkeypatch):
    import torch
    perf = perf_module("common")
    blas = ["default"]      # this CPU build of torch refuses cuBLASLt: the setting is faked

    def preferred_blas_library(backend=None):
        if backend is not None:
            blas[0] = str(backend)
        return blas[0]
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred_blas_library)
    seen = []
    perf.run_variants("blaslt,mbt2048,default", FakeLLM, lambda llm, label: seen.append(
        (label, blas[0], llm.overrides.get("max_num_batched_tokens"))))
    assert seen == [("default", "default", None), ("blaslt", "cublaslt", None),
                    ("blaslt-mbt2048", "cublaslt", 2048), ("default-again", "default", None)]


def test_repeated_default_runs_get_labels_of_their_own(perf_module):
    # the labels name the result files: two re-runs of the default must not share one
    perf = perf_module("common")
    labels = []
    perf.run_variants("default,default", FakeLLM, lambda llm, label: labels.append(label))
    assert labels == ["default", "default-again", "default-again-2"]


def test_unknown_variant_is_refused_by_name(perf_module):
    perf = perf_module("common")
    with pytest.raises(SystemExit, match="'fastest'"):
        perf.run_variants("fastest", FakeLLM, lambda llm, label: None)


def test_decode_switches_are_set_and_restored(perf_module):
    # gridorder and decode3 change the decode kernel's program order and pipeline depth for
    # the engines after them; default puts both back
    from pagedbackend.kernels import decode
    perf = perf_module("common")
    start = (decode.LONGEST_FIRST, decode.decode_config)
    stages = decode.decode_config(128)["num_stages"]
    seen = []
    try:
        perf.run_variants("gridorder,decode3,default", FakeLLM, lambda llm, label: seen.append(
            (label, decode.LONGEST_FIRST, decode.decode_config(128)["num_stages"])))
    finally:
        decode.LONGEST_FIRST, decode.decode_config = start
    assert seen == [("default", start[0], stages), ("gridorder", False, stages),
                    ("gridorder-decode3", False, 3), ("default-again", start[0], stages)]


def test_fp8kv_builds_the_next_engines_with_an_fp8_cache(perf_module):
    # fp8kv is an engine argument, kept by the variants after it until a default; fp8n64
    # gives fp8 caches bf16's decode tile, and default puts FP8_BLOCK_N back
    from pagedbackend.kernels import decode
    perf = perf_module("common")
    start = decode.FP8_BLOCK_N
    seen = []
    try:
        perf.run_variants("fp8kv,fp8n64,mbt2048,default", FakeLLM, lambda llm, label: seen.append(
            (label, llm.overrides, decode.decode_config(128, 1)["BLOCK_N"])))
    finally:
        decode.FP8_BLOCK_N = start
    assert start != 64 and decode.decode_config(128)["BLOCK_N"] == 64
    fp8 = {"kv_cache_dtype": "fp8"}
    assert seen == [("default", {}, start), ("fp8kv", fp8, start), ("fp8kv-fp8n64", fp8, 64),
                    ("fp8kv-fp8n64-mbt2048", {**fp8, "max_num_batched_tokens": 2048}, 64),
                    ("default-again", {}, start)]
    # fp8w (fp8 weights) is one too, and combines with fp8kv
    seen.clear()
    perf.run_variants("fp8w,fp8kv", FakeLLM, lambda llm, label: seen.append((label, llm.overrides,
                                                                             0)))
    assert seen == [("default", {}, 0), ("fp8w", {"quantization": "fp8"}, 0),
                    ("fp8w-fp8kv", {"quantization": "fp8", **fp8}, 0)]
    # awq / gptq / int8 weights: one weight kind at a time, each naming the result's model
    seen.clear()
    perf.run_variants("awq,gptq,int8,fp8kv", FakeLLM,
                      lambda llm, label: seen.append((label, llm.overrides)))
    assert seen == [("default", {}), ("awq", {"quantization": "awq"}),
                    ("gptq", {"quantization": "gptq"}), ("int8", {"quantization": "int8"}),
                    ("int8-fp8kv", {"quantization": "int8", **fp8})]
    assert perf.result_model("llama-3.1-8b", "awq") == ("llama-3.1-8b-awq", "")
    assert perf.result_model("llama-3.1-8b", "fp8w") == ("llama-3.1-8b", "fp8w")


def test_without_variants_no_switch_module_is_needed(perf_module, monkeypatch):
    """perf/snapshot.sh runs today's scripts against an older engine, which may lack a module
    the A/B switches live in: without --ab, run_variants must not import them."""
    import sys

    import pagedbackend.kernels
    perf = perf_module("common")
    monkeypatch.setitem(sys.modules, "pagedbackend.kernels.gemv_tuning", None)   # as if absent
    monkeypatch.delattr(pagedbackend.kernels, "gemv_tuning", raising=False)
    seen = []
    perf.run_variants("", FakeLLM, lambda llm, label: seen.append(label))
    assert seen == ["default"]
    with pytest.raises(ImportError):
        perf.run_variants("cublas", FakeLLM, lambda llm, label: None)


@pytest.mark.parametrize("variant,module,switch", [
    ("fp8nofuse", "pagedbackend.layers.fp8_inputs", "FUSED_QUANT"),
    ("fp8w8a8", "pagedbackend.kernels.fp8_mma", "W8A8_DECODE")])
def test_fp8_switches_hold_until_default(perf_module, variant, module, switch):
    """fp8nofuse turns the fused input quantization off, fp8w8a8 the tensor-core W8A8 decode
    on; each stays with the fp8 weights after it and "default" restores the start."""
    import importlib
    mod = importlib.import_module(module)
    perf = perf_module("common")
    start = getattr(mod, switch)
    seen = []
    try:
        perf.run_variants(f"fp8w,{variant},default", FakeLLM, lambda llm, label: seen.append(
            (label, llm.overrides, getattr(mod, switch))))
    finally:
        setattr(mod, switch, start)
    fp8 = {"quantization": "fp8"}
    assert seen == [("default", {}, start), ("fp8w", fp8, start),
                    (f"fp8w-{variant}", fp8, not start), ("default-again", {}, start)]


def test_fp8oldtiles_tunes_again_without_the_widening_tiles(perf_module):
    from pagedbackend.kernels import gemv_tuning
    perf = perf_module("common")
    start = gemv_tuning.FP8_WIDEN_CANDIDATES
    seen = []

    def body(llm, label):
        seen.append((label, len(gemv_tuning.FP8_WIDEN_CANDIDATES), dict(gemv_tuning._CHOICE)))
        gemv_tuning._CHOICE[label] = None       # as if this engine had tuned a shape
    try:
        perf.run_variants("fp8oldtiles,default", FakeLLM, body)
    finally:
        gemv_tuning.FP8_WIDEN_CANDIDATES = start
        for label in ("default", "fp8oldtiles", "default-again"):
            gemv_tuning._CHOICE.pop(label, None)
    # each engine after a switch of the tile set starts with no choices of the other set
    assert start and [(label, n, "default" in c or "fp8oldtiles" in c) for label, n, c in seen] \
        == [("default", len(start), False), ("fp8oldtiles", 0, False),
            ("default-again", len(start), False)]
