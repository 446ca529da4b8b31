"""Stream a completion from a running server and print text as it arrives.

    python -m client.stream "What is the capital of France?" --chat --max-tokens 64
"""
from __future__ import annotations

import argparse
import os
import sys

from client.triton_client import InferenceServerException, TritonLLMClient

DEFAULT_TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "models", "smollm2-135m-instruct")


def chat_prompt(user: str, tokenizer_dir: str, system: str | None = None) -> str:
    from transformers import AutoTokenizer

    messages = ([{"role": "system", "content": system}] if system else []) + \
        [{"role": "user", "content": user}]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m client.stream", description=__doc__)
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--tokenizer", default=os.environ.get("PAGEDBACKEND_MODEL", DEFAULT_TOKENIZER),
                   help="model directory holding the chat template (with --chat)")
    p.add_argument("--url", default=os.environ.get("TRITON_GRPC_URL", "127.0.0.1:8001"))
    p.add_argument("--model", default="ensemble")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--presence-penalty", type=float, default=None)
    p.add_argument("--frequency-penalty", type=float, default=None)
    p.add_argument("--min-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--usage", action="store_true", help="print token counts at the end")
    a = p.parse_args(argv)
    prompt = chat_prompt(a.prompt, a.tokenizer, a.system) if a.chat else a.prompt
    sampling = dict(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                    top_k=a.top_k, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
                    presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty,
                    min_tokens=a.min_tokens, seed=a.seed, ignore_eos=a.ignore_eos)
    last = None
    try:
        with TritonLLMClient(a.url, a.model) as client:
            for last in client.stream(prompt, stop=a.stop, **sampling):
                sys.stdout.write(last.text)
                sys.stdout.flush()
    except InferenceServerException as e:
        print(f"\nerror: {e.message()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print()
    if a.usage and last is not None:
        print(f"[finish_reason={last.finish_reason} prompt_tokens={last.num_input_tokens}]",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
