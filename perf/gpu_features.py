"""The sampling features of 2026-12-03 on the GPU, where CUDA graphs, the triton argmax and
async scheduling are on (the CPU suite covers their logic without them): a small random llama in
fp32 against transformers on the same weights.

- prompt_logprobs: every prompt token's logprob as transformers' log-softmax (chunked prefill;
  such steps leave the graphs), and the same greedy tokens with and without them;
- logit_bias +100 forces its token; allowed_token_ids hold under sampling.
Prints one line per check and a table; exits 1 if one fails. Runs on the CPU too (a smoke run:
no graphs, no async scheduling there).
"""
from __future__ import annotations

import random
import sys
import tempfile

import torch

from common import print_table

SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, vocab_size=1024,
             max_position_embeddings=1024)


def main() -> int:
    from pagedbackend import LLM, SamplingParams
    from pagedbackend.testing import make_hf_checkpoint
    d = tempfile.mkdtemp()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hf = make_hf_checkpoint("llama", d, seed=1, std=0.05, **SHAPE).to(dev, torch.float32)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 1024) for _ in range(rng.randrange(3, 300))] for _ in range(8)]
    llm = LLM(d, dtype="float32", block_size=16, max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=256)
    assert llm.engine.async_scheduling or dev == "cpu"
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    rows = []

    def record(name, ok, detail):
        rows.append({"check": name, "ok": ok, "detail": detail})
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)

    plain = llm.generate(batch, greedy)
    scored = llm.generate(batch, greedy.clone(prompt_logprobs=3))
    record("prompt_logprobs keep the tokens",
           [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in scored],
           "greedy tokens with and without prompt_logprobs")
    worst = 0.0
    for p, o in zip(prompts, scored):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([p], device=dev)).logits[0].double(), -1)
        got = o.prompt_logprobs
        if got is None or len(got) != len(p):
            worst = float("inf")
            continue
        worst = max([worst] + [abs(got[j][p[j]] - ref[j - 1, p[j]].item())
                               for j in range(1, len(p))])
    record("prompt_logprobs match transformers", worst < 1e-3, f"max |diff| {worst:.2e}")
    target = 777
    forced = llm.generate(batch[:4], greedy.clone(max_tokens=8, logit_bias={target: 100}))
    record("logit_bias +100 forces its token",
           all(o.outputs[0].token_ids == [target] * 8 for o in forced), f"token {target}")
    allowed = [3, 50, 900]
    sampled = llm.generate(batch, SamplingParams(temperature=1.5, seed=3, max_tokens=16,
                                                 ignore_eos=True, allowed_token_ids=allowed))
    got = {t for o in sampled for t in o.outputs[0].token_ids}
    record("allowed_token_ids hold", got <= set(allowed), f"sampled {sorted(got)}")
    llm.engine.check_invariants()
    print_table(rows, f"sampling features on {dev} (llama, fp32)")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
