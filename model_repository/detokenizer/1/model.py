"""Triton `detokenizer` model: one engine response -> one text delta.

Stateless: the engine sends the few ids before the new ones as context, and
pagedbackend.engine.detokenizer.decode_delta turns (context, new) into exactly the text the new
ids add, so deltas from any number of instances concatenate to the non-streamed text. When the
engine made the text itself (requests with stop strings), it is passed through unchanged."""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pagedbackend.serving.settings import parameters_of, resolve_path  # noqa: E402

PASS_THROUGH = (("engine_finish_reason", "finish_reason"),
                ("engine_num_output_tokens", "num_output_tokens"))


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        from pagedbackend.engine.detokenizer import decode_delta

        params = parameters_of(json.loads(args["model_config"]))
        self.decode_delta = decode_delta
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_path(params["tokenizer_dir"], ROOT))
        self.skip_special = params.get("skip_special_tokens", "true").lower() == "true"

    def execute(self, requests):
        return [self._one(r) for r in requests]

    def _logprobs(self, tensor) -> bytes:
        """Engine logprobs (token ids) -> the `logprobs` output with each token's text."""
        raw = b"" if tensor is None else tensor.reshape(-1)[0]
        if not raw:
            return b""
        piece = lambda t: self.tokenizer.decode([t], clean_up_tokenization_spaces=False)
        entries = [{"token": piece(e["token_id"]), "token_id": e["token_id"],
                    "logprob": e["logprob"],
                    "top_logprobs": [[piece(t), lp] for t, lp in e["top_logprobs"]]}
                   for e in json.loads(raw)]
        return json.dumps(entries).encode("utf-8")

    def _one(self, request):
        def get(name):
            t = pb_utils.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        if bool(get("engine_text_valid").reshape(-1)[0]):
            text = get("engine_text").reshape(-1)[0].decode("utf-8")
        else:
            text = self.decode_delta(self.tokenizer, get("context_ids").reshape(-1).tolist(),
                                     get("output_ids").reshape(-1).tolist(),
                                     skip_special_tokens=self.skip_special)
        text = get("prefix_text").reshape(-1)[0].decode("utf-8") + text   # echoed prompt
        out = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object)),
               pb_utils.Tensor("logprobs", np.array([[self._logprobs(get("engine_logprobs"))]],
                                                    dtype=object)),
               pb_utils.Tensor("prompt_logprobs", np.array(
                   [[self._logprobs(get("engine_prompt_logprobs"))]], dtype=object))]
        out += [pb_utils.Tensor(dst, get(src).reshape(1, 1)) for src, dst in PASS_THROUGH]
        return pb_utils.InferenceResponse(output_tensors=out)
