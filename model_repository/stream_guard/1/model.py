"""Triton `stream_guard` model: turns a client's cancel into an engine abort. Triton 2.51 cancels
only the ensemble steps scheduled after a cancel, so the running (decoupled) engine step never sees
it; the next response's guard step does, and sends the engine a `stop` request naming the
engine's request_key. The guard runs beside the detokenizer, scheduled just before it (see
ensemble/config.pbtxt), and only passes `num_input_tokens` on: a branch of the ensemble must
produce one of its tensors."""
import json
from collections import OrderedDict

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        self.engine = params.get("engine_model", {}).get("string_value", "engine")
        self.stopped = OrderedDict()        # keys already stopped (bounded; responses repeat)

    def execute(self, requests):
        responses = []
        for request in requests:
            if request.is_cancelled():
                self._stop(request)
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                    "the request was cancelled", pb_utils.TritonError.CANCELLED)))
                continue
            n = pb_utils.get_input_tensor_by_name(request, "num_input_tokens").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("num_input_tokens", n)]))
        return responses

    def _stop(self, request):
        key = pb_utils.get_input_tensor_by_name(request, "request_key").as_numpy().reshape(-1)[0]
        key = key.decode() if isinstance(key, bytes) else str(key)
        if key in self.stopped:
            return
        self.stopped[key] = True
        if len(self.stopped) > 4096:
            self.stopped.popitem(last=False)
        try:
            stop = pb_utils.InferenceRequest(
                model_name=self.engine, request_id=key, requested_output_names=[],
                inputs=[pb_utils.Tensor("stop", np.array([[True]], dtype=bool))])
            for _ in stop.exec(decoupled=True):
                pass
        except Exception as e:  # noqa: BLE001 - the request may have finished meanwhile
            pb_utils.Logger.log_warn(f"could not stop engine request {key}: {e}")
