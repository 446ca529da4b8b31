"""Triton `engine` model: one decoupled instance embedding pagedbackend's LLMEngine.

Threading model (the code lives in pagedbackend/serving/engine_loop.py and sender.py):
- execute() runs on Triton's thread; it parses each request (pagedbackend.serving.request) and
  only enqueues it for the loop (or a parse error for the sender), then returns None.
- One loop thread owns the engine: it alone calls add_request / step / abort / stats.
- One sender thread is the only place that calls response_sender.send() and is_cancelled() (all
  stub IPC on one thread); every request gets exactly one response flagged FINAL (data
  piggy-backed, or an error), also on error and cancel. A request's chunks queued behind a busy
  sender go out merged as one response. Between sends it polls is_cancelled() on a bounded
  round-robin of open requests; the loop aborts cancelled requests before its next step, which
  frees their KV blocks at once.
- vLLM-named metrics (pb_utils.MetricFamily) are queued by the loop and published by the sender
  thread too, every 0.1 s: besides execute(), only the sender thread makes stub IPC calls. Under
  W4 load with one response per step (max_responses_per_s 0) tritonserver died of heap
  corruption ("malloc(): unaligned tcache chunk detected") in 2 of 5 CPU runs while a separate
  metrics thread made IPC calls alongside the sender.
Nothing else is shared; the only lock guards the open-request table read by the sender's polls.
"""
import json
import sys
import uuid
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

ROOT = Path(__file__).resolve().parents[3]      # this checkout, when pagedbackend isn't installed
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pagedbackend.serving.admission import AdmissionConfig  # noqa: E402
from pagedbackend.serving.engine_loop import EngineLoop  # noqa: E402
from pagedbackend.serving.metrics import ServingMetrics, cache_config_labels  # noqa: E402
from pagedbackend.serving.request import (RequestError, check_single_batch,  # noqa: E402
                                          parse_request)
from pagedbackend.serving.responses import Outgoing  # noqa: E402
from pagedbackend.serving.settings import (engine_config, parameters_of,  # noqa: E402
                                           streaming_options)
from pagedbackend.worker.orphan import exit_when_orphaned  # noqa: E402

ERROR_CODES = {"invalid": "INVALID_ARG", "cancelled": "CANCELLED", "unavailable": "UNAVAILABLE",
               "internal": "INTERNAL"}


class TritonPythonModel:
    def initialize(self, args):
        from pagedbackend.engine.llm_engine import LLMEngine

        self.model_config = json.loads(args["model_config"])
        self.name = args["model_name"]
        params = parameters_of(self.model_config)
        config = engine_config(params, ROOT)
        streaming = streaming_options(params)   # checked before the (slow) engine build
        admission = AdmissionConfig.from_parameters(params)
        self.input_names = [i["name"] for i in self.model_config["input"] if i["name"] != "stop"]
        self.log = pb_utils.Logger
        exit_when_orphaned()        # a stub outliving its server would hold the model forever
        # Built before initialize() returns: Triton reports the model ready only after this.
        self.engine = LLMEngine(config)
        # generation_config.json's sampling values, for the fields a request leaves unset
        self.sampling_defaults = self.engine.default_sampling_fields()
        served = params.get("served_model_name") or Path(config.model).name
        spec = config.speculative_config
        self.metrics = ServingMetrics(pb_utils, served, log=self.log.log_warn,
                                      cache_config=cache_config_labels(self.engine),
                                      num_speculative_tokens=spec and spec.num_speculative_tokens)
        self.loop = EngineLoop(self.engine, self._send, self.metrics, log=self.log.log_error,
                               on_dead=self._unload_self, info=self.log.log_info,
                               admission=admission, **streaming).start()
        self.log.log_info(f"engine ready: {self.engine.info}")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            stop = pb_utils.get_input_tensor_by_name(request, "stop")
            if stop is not None and bool(stop.as_numpy().reshape(-1)[0]):
                self.loop.stop(request.request_id(), sender)   # TensorRT-LLM's stop + request id
                continue
            try:
                inputs = {}
                for name in self.input_names:
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    inputs[name] = None if tensor is None else tensor.as_numpy()
                check_single_batch(inputs)
                parsed = parse_request(inputs, json.loads(request.parameters() or "{}"),
                                       defaults=self.sampling_defaults)
                self.loop.submit(sender, parsed, key=uuid.uuid4().hex)
            except RequestError as e:
                self.loop.reject(sender, str(e))
            except Exception as e:  # noqa: BLE001 - a parse bug fails this request only, and
                # its traceback (paths, internals) goes to the log, not to the client
                self.log.log_error(f"request rejected: {type(e).__name__}: {e}")
                self.loop.reject(sender, "the request could not be parsed", "internal")
        return None

    def _send(self, sender, item: Outgoing):
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if item.final else 0
        if item.error is None and item.chunk is None:
            sender.send(flags=flags)
            return
        if item.error is not None:
            code = getattr(pb_utils.TritonError, ERROR_CODES[item.error_kind])
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(item.error, code)),
                        flags=flags)
            return
        c = item.chunk
        tensors = [
            pb_utils.Tensor("output_ids", np.array([c.token_ids], dtype=np.int32)),
            pb_utils.Tensor("context_ids", np.array([c.context_ids], dtype=np.int32)),
            pb_utils.Tensor("engine_text", np.array([[(c.text or "").encode()]], dtype=object)),
            pb_utils.Tensor("engine_text_valid", np.array([[c.text is not None]], dtype=bool)),
            pb_utils.Tensor("prefix_text", np.array([[c.prefix.encode()]], dtype=object)),
            pb_utils.Tensor("finish_reason",
                            np.array([[(c.finish_reason or "").encode()]], dtype=object)),
            pb_utils.Tensor("num_input_tokens", np.array([[c.num_input_tokens]], np.uint32)),
            pb_utils.Tensor("num_output_tokens", np.array([[c.num_output_tokens]], np.uint32)),
            pb_utils.Tensor("request_key", np.array([[c.request_key.encode()]], dtype=object)),
            pb_utils.Tensor("logprobs", np.array([[c.logprobs_json().encode()]], dtype=object)),
            pb_utils.Tensor("prompt_logprobs",
                            np.array([[c.prompt_logprobs_json().encode()]], dtype=object)),
        ]
        sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)

    def _unload_self(self):
        # Triton does not restart a decoupled stub: unloading makes the model (and the ensemble)
        # report not-ready. Needs --model-control-mode=explicit, which scripts/serve.py uses.
        try:
            pb_utils.unload_model(self.name)
        except Exception as e:  # noqa: BLE001
            self.log.log_error(f"could not unload {self.name} after the engine failed: {e}")

    def finalize(self):
        self.loop.shutdown()
        self.metrics.close()
