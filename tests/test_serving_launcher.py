"""Launcher pieces that need no server: parameter substitution, repository materialisation,
environment overrides, typed engine settings."""
from pathlib import Path

import pytest

from pagedbackend.serving.launcher import (MODEL_REPOSITORY, env_overrides,
                                           materialize_repository, set_parameter)
from pagedbackend.serving.settings import engine_config, parameters_of, streaming_options


def test_set_parameter_replaces_or_appends():
    text = 'parameters: { key: "block_size" value: { string_value: "16" } }\n'
    assert 'string_value: "32"' in set_parameter(text, "block_size", "32")
    added = set_parameter(text, "dtype", 'a"b')
    assert 'key: "dtype" value: { string_value: "a\\"b" }' in added


def test_materialize_substitutes_engine_settings(tmp_path):
    out = materialize_repository(tmp_path / "repo", {"max_model_len": "1024", "model": "m/x"})
    engine = (out / "engine" / "config.pbtxt").read_text()
    assert 'key: "max_model_len" value: { string_value: "1024" }' in engine
    model = str((MODEL_REPOSITORY.parent / "m/x").resolve())
    assert f'string_value: "{model}"' in engine
    assert f'string_value: "{model}"' in (out / "tokenizer" / "config.pbtxt").read_text()
    for name in ("tokenizer", "engine", "detokenizer", "stream_guard", "ensemble"):
        assert (out / name / "1").resolve() == (MODEL_REPOSITORY / name / "1").resolve()


def test_env_overrides():
    env = {"PAGEDBACKEND_BLOCK_SIZE": "32", "PAGEDBACKEND_DTYPE": "", "OTHER": "1"}
    assert env_overrides(env) == {"block_size": "32"}


def test_streaming_options_typed_and_checked():
    assert streaming_options({}) == {"coalesce": True, "max_responses_per_s": 0.0,
                                     "queued_probe_s": 1.0}
    assert streaming_options({"stream_coalesce": "false", "max_responses_per_s": "1000",
                              "queued_probe_ms": "0"}) == \
        {"coalesce": False, "max_responses_per_s": 1000.0, "queued_probe_s": 0.0}
    with pytest.raises(ValueError, match=r"^parameter queued_probe_ms=-5.0 is invalid: must be "
                                         r"a number >= 0 \(0: off\)"):
        streaming_options({"queued_probe_ms": "-5"})
    with pytest.raises(ValueError, match=r"^parameter stream_coalesce='maybe' is invalid"):
        streaming_options({"stream_coalesce": "maybe"})
    with pytest.raises(ValueError, match=r"^parameter max_responses_per_s=-1.0 is invalid: must be "
                                         r"a number >= 0"):
        streaming_options({"max_responses_per_s": "-1"})
    with pytest.raises(ValueError, match=r"^parameter max_responses_per_s='fast' is invalid"):
        streaming_options({"max_responses_per_s": "fast"})


def test_engine_config_from_parameters():
    params = parameters_of({"parameters": {
        "model": {"string_value": "models/x"}, "block_size": {"string_value": "32"},
        "enable_prefix_caching": {"string_value": "false"},
        "max_model_len": {"string_value": "${max_model_len}"},      # unfilled template: default
        "served_model_name": {"string_value": "smol"}}})
    cfg = engine_config(params, Path("/repo"))
    assert (cfg.model, cfg.block_size, cfg.enable_prefix_caching, cfg.max_model_len) == \
        ("/repo/models/x", 32, False, None)
    with pytest.raises(ValueError, match="block_size"):
        engine_config({"model": "x", "block_size": "big"}, Path("/"))
    with pytest.raises(ValueError, match="block_size"):
        engine_config({"model": "x", "block_size": "3"}, Path("/"))
    # the fp8 KV cache is a parameter too (in the shipped config.pbtxt, "auto")
    assert engine_config({"model": "x", "kv_cache_dtype": "fp8"}, Path("/")).kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match=r"^kv_cache_dtype='fp4' is invalid: must be one of"):
        engine_config({"model": "x", "kv_cache_dtype": "fp4"}, Path("/"))
    shipped = (Path(__file__).parents[1] / "model_repository/engine/config.pbtxt").read_text()
    assert 'key: "kv_cache_dtype" value: { string_value: "auto" }' in shipped
    # quantized weights: the shipped value is empty (the weights as loaded; an AWQ / GPTQ
    # checkpoint is found from its config.json without it)
    for method in ("fp8", "int8", "awq", "gptq"):
        assert engine_config({"model": "x", "quantization": method},
                             Path("/")).quantization == method
    assert engine_config(parameters_of({"parameters": {
        "model": {"string_value": "x"}, "quantization": {"string_value": ""}}}),
        Path("/")).quantization is None
    with pytest.raises(ValueError, match=r"^quantization='int4' is invalid: must be None or one "
                                         r"of \('fp8', 'int8', 'awq', 'gptq'\)"):
        engine_config({"model": "x", "quantization": "int4"}, Path("/"))
    assert 'key: "quantization" value: { string_value: "" }' in shipped


def test_wait_ready_waits_for_the_metrics_endpoint_too():
    """tritonserver answers /v2/health/ready before its metrics endpoint listens: ready means
    both answer (a scrape right after readiness was refused once in this suite)."""
    import http.server
    import threading

    from pagedbackend.serving.launcher import TritonServer, free_port

    class Ok(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    def serve():
        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        return httpd

    health = serve()
    server = TritonServer.__new__(TritonServer)     # no binary needed: only the ports matter
    server.proc = None
    server.http_port, server.metrics_port = health.server_address[1], free_port()
    try:
        with pytest.raises(TimeoutError, match="/metrics"):
            server.wait_ready(timeout=1.5)
        metrics = serve()
        server.metrics_port = metrics.server_address[1]
        server.wait_ready(timeout=5)
        metrics.shutdown()
    finally:
        health.shutdown()
