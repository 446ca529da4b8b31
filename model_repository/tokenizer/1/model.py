"""Triton `tokenizer` model: text_input -> input_ids with the engine model's HF tokenizer.
Dynamic batching hands several requests to one execute(); they are encoded in one call."""
import json
import sys
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pagedbackend.serving.request import RequestError, max_prompt_chars, one_string  # noqa: E402
from pagedbackend.serving.settings import parameters_of, resolve_path  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        from transformers import AutoTokenizer

        params = parameters_of(json.loads(args["model_config"]))
        folder = resolve_path(params["tokenizer_dir"], ROOT)
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        with open(Path(folder) / "config.json") as f:
            context = int(json.load(f).get("max_position_embeddings", 1 << 17))
        # longer texts cannot fit any max_model_len: refused before tokenizing
        self.max_chars = max_prompt_chars(self.tokenizer, context)

    def execute(self, requests):
        texts, errors = [], []
        for request in requests:
            try:
                arr = pb_utils.get_input_tensor_by_name(request, "text_input").as_numpy()
                if arr.shape[0] != 1:
                    raise RequestError(f"text_input has batch size {arr.shape[0]}: must be 1 "
                                       "(send one prompt per request)")
                text = one_string(arr, "text_input")
                if not text:
                    raise RequestError("text_input is empty: must be a non-empty string")
                if len(text) > self.max_chars:
                    raise RequestError(f"text_input=<{len(text)} characters> is invalid: must be "
                                       f"at most {self.max_chars} characters (no longer text "
                                       "fits the model's context)")
                texts.append(text)
                errors.append(None)
            except RequestError as e:
                texts.append("")
                errors.append(str(e))
        valid = [t for t, e in zip(texts, errors) if e is None]
        encoded = self.tokenizer(valid)["input_ids"] if valid else []
        responses, it = [], iter(encoded)
        for error in errors:
            if error is not None:
                responses.append(pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(error, pb_utils.TritonError.INVALID_ARG)))
            else:
                ids = np.array([next(it)], dtype=np.int32)
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("input_ids", ids)]))
        return responses
