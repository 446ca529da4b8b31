"""Request parsing for the Triton models, from plain numpy dicts (no Triton needed)."""
import json

import numpy as np
import pytest

from pagedbackend.serving.request import RequestError, check_single_batch, parse_request


def s(*values):
    return np.array([[v.encode() for v in values]], dtype=object)


def i32(v):
    return np.array([[v]], dtype=np.int32)


def f32(v):
    return np.array([[v]], dtype=np.float32)


def test_defaults_and_tensors():
    r = parse_request({"text_input": s("hi")})
    assert r.prompt == "hi" and r.prompt_token_ids is None
    assert r.exclude_input_in_output is True and r.stream is False and r.priority == 0
    r = parse_request({"text_input": s("hi"), "max_tokens": i32(7), "temperature": f32(0.5),
                       "top_k": i32(3), "top_p": f32(0.9), "stream": np.array([[True]]),
                       "seed": np.array([[2**63 + 5]], dtype=np.uint64),
                       "stop_words": s("a", "bc"), "ignore_eos": np.array([[True]]),
                       "priority": i32(-2), "cache_salt": s("salt")})
    p = r.params
    assert (p.max_tokens, p.temperature, p.top_k, p.seed, p.stop, p.ignore_eos) == \
        (7, 0.5, 3, 2**63 + 5, ["a", "bc"], True)
    assert r.stream and r.priority == -2 and r.cache_salt == "salt"


def test_aliases_min_length_and_random_seed():
    r = parse_request({"text_input": s("x"), "min_length": i32(3), "max_tokens": i32(5),
                       "random_seed": np.array([[9]], dtype=np.uint64)})
    assert r.params.min_tokens == 3 and r.params.seed == 9


def test_sampling_parameters_json_strings_and_precedence():
    sp = json.dumps({"temperature": "0.25", "max_tokens": "12", "stop": ["x"],
                     "ignore_eos": "true", "top_k": 5})
    r = parse_request({"text_input": s("x"), "sampling_parameters": s(sp), "top_k": i32(2)},
                      {"max_tokens": "3", "temperature": 1.5})
    # request parameters < JSON < separate tensors
    assert (r.params.temperature, r.params.max_tokens, r.params.top_k) == (0.25, 12, 2)
    assert r.params.stop == ["x"] and r.params.ignore_eos is True


def test_token_controls_from_tensors_json_and_request_parameters():
    sp = json.dumps({"logit_bias": {"17": -100, "3": 2.5}, "allowed_token_ids": [9, 3, 9]})
    r = parse_request({"text_input": s("x"), "sampling_parameters": s(sp),
                       "bad_words": s("darn", "", "heck")})
    assert r.params.logit_bias == {17: -100.0, 3: 2.5}
    assert r.params.allowed_token_ids == [3, 9] and r.params.bad_words == ["darn", "heck"]
    # Triton request parameters are strings: the object arrives as its JSON text
    r = parse_request({"text_input": s("x")}, {"logit_bias": '{"5": 1}', "bad_words": "oops"})
    assert r.params.logit_bias == {5: 1.0} and r.params.bad_words == ["oops"]


def b(v):
    return np.array([[v]], dtype=bool)


def test_tensorrt_llm_extras():
    r = parse_request({"text_input": s("x"), "end_id": i32(7), "pad_id": i32(0),
                       "beam_width": i32(1), "num_return_sequences": i32(1),
                       "length_penalty": f32(1.5), "return_log_probs": b(True),
                       "guided_decoding_guide_type": s("json_schema"),
                       "guided_decoding_guide": s('{"type": "object"}'),
                       "stop_words": s("END")})
    p = r.params
    assert p.stop_token_ids == [7] and p.stop == ["END"] and p.logprobs == 0
    assert p.structured_outputs == {"json": '{"type": "object"}'}
    assert r.beam_width == 1 and r.length_penalty == 1.5
    r = parse_request({"text_input": s("x"), "beam_width": i32(4)})
    assert r.beam_width == 4 and r.length_penalty == 1.0      # the engine loop runs the beams
    # perf/ensemble_input.json's neutral values change nothing
    r = parse_request({"text_input": s("x"), "end_id": i32(-1), "return_log_probs": b(False),
                       "guided_decoding_guide_type": s(""), "guided_decoding_guide": s("")})
    assert r.params == parse_request({"text_input": s("x")}).params
    for kind, guide, want in (("json", "", {"json_object": True}), ("regex", "[0-9]+",
                              {"regex": "[0-9]+"}), ("ebnf_grammar", 'root ::= "a"',
                              {"grammar": 'root ::= "a"'})):
        r = parse_request({"text_input": s("x"), "guided_decoding_guide_type": s(kind),
                           "guided_decoding_guide": s(guide)})
        assert r.params.structured_outputs == want


@pytest.mark.parametrize("inputs, field", [
    ({"beam_width": i32(11)}, "beam_width=11 is invalid: must be an integer in [1, 10]"),
    ({"beam_width": i32(0)}, "beam_width=0"),
    ({"num_return_sequences": i32(2)}, "num_return_sequences=2"),
    ({"guided_decoding_guide_type": s("structural_tag")}, "guided_decoding_guide_type"),
    ({"guided_decoding_guide_type": s("regex")}, "guided_decoding_guide is missing"),
    ({"end_id": f32(2.0)}, "end_id"),
    ({"sampling_parameters": s('{"logit_bias": [1]}')}, "logit_bias"),
    ({"sampling_parameters": s('{"logit_bias": {"1": "lots"}}')}, "logit_bias[1]"),
    ({"sampling_parameters": s('{"allowed_token_ids": "none"}')}, "allowed_token_ids"),
    ({"temperature": f32(-1.0)}, "temperature"),
    ({"top_p": f32(0.0)}, "top_p"),
    ({"top_k": i32(0)}, "top_k"),
    ({"min_p": f32(1.5)}, "min_p"),
    ({"repetition_penalty": f32(0.0)}, "repetition_penalty"),
    ({"presence_penalty": f32(3.0)}, "presence_penalty"),
    ({"frequency_penalty": f32(-3.0)}, "frequency_penalty"),
    ({"max_tokens": i32(0)}, "max_tokens"),
    ({"max_tokens": i32(2147483647)}, "max_tokens"),
    ({"max_tokens": i32(4), "min_tokens": i32(9)}, "min_tokens"),
    ({"sampling_parameters": s("{not json")}, "sampling_parameters"),
    ({"sampling_parameters": s('{"bogus": 1}')}, "sampling_parameters.bogus"),
    ({"sampling_parameters": s('{"n": 2}')}, "n="),
    ({"sampling_parameters": s('{"max_tokens": "many"}')}, "sampling_parameters.max_tokens"),
    ({"temperature": s("hot")}, "temperature"),
    ({"max_tokens": f32(3.0)}, "max_tokens"),
    ({"max_tokens": np.array([[1, 2]], dtype=np.int32)}, "max_tokens"),
])
def test_bad_values_name_the_field(inputs, field):
    with pytest.raises(RequestError) as e:
        parse_request({"text_input": s("x"), **inputs})
    assert field in str(e.value)


def test_absurd_max_tokens_message_gives_the_range():
    with pytest.raises(RequestError, match=r"max_tokens=2147483647 is invalid: must be an integer"):
        parse_request({"text_input": s("x"), "max_tokens": i32(2147483647)})


def test_prompt_forms():
    with pytest.raises(RequestError, match="text_input is missing"):
        parse_request({"max_tokens": i32(3)})
    with pytest.raises(RequestError, match="text_input is empty"):
        parse_request({"text_input": s("")})
    r = parse_request({"input_ids": np.array([[1, 2, 3]], dtype=np.int32), "text_input": s("t")})
    assert r.prompt_token_ids == [1, 2, 3] and r.prompt == "t"
    assert r.engine_prompt() == [1, 2, 3]
    with pytest.raises(RequestError, match="input_ids"):
        parse_request({"input_ids": np.array([[-1]], dtype=np.int32)})
    with pytest.raises(RequestError, match="input_ids"):
        parse_request({"input_ids": np.zeros((1, 0), dtype=np.int32)})


def test_batch_of_two_is_rejected():
    with pytest.raises(RequestError, match="batch size 2"):
        check_single_batch({"text_input": np.array([[b"a"], [b"b"]], dtype=object)})
    check_single_batch({"text_input": s("a"), "max_tokens": None})
