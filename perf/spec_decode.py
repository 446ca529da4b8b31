"""Speculative decoding against no speculation, in one process (the same engine with its
drafter switched off for the baseline, so the same kernels and tile choices).

GPU (default; llama-3.1-8b dummy weights, 128-token prompts, 128 output tokens, greedy):
  ceiling   batch 1, n-gram k=5 on a prompt made to repeat (the prompt followed by the model's
            own answer to it, so the answer repeats), against W1 on the same prompt
  reject    batch 1, drafts that are never accepted (k random tokens): the overhead, with the
            backoff (the default) and without it (every round verifies)
  no-drafts batch 1, a proposer that finds nothing: the cost of the drafter being on
  draft     batch 1, a draft model identical to the target (acceptance 100%, the mechanism
            alone: the draft costs as much as the target, so no speed-up is expected)
  batch     batch 1, 4, 16, 32, 64 with n-gram drafts on repeating prompts: where it stops paying
CPU (--cpu; SmolLM2-135M-Instruct, real weights): n-gram drafts on "repeat / edit this
paragraph" chat prompts, acceptance rate and speed-up against no speculation.
Prints a table last; writes perf/results/spec_decode-<model>-<gpu>.json."""
from __future__ import annotations

import argparse
import gc
import os
import random
import time

from common import ROOT, dummy_model_dir, print_table, random_prompts, timed, write_result

PARAGRAPH = ("The committee met on Tuesday to review the budget for the coming year. After a "
             "long discussion, the members agreed to increase funding for the public library, "
             "to repair the roads near the river, and to hire two more teachers for the primary "
             "school. The mayor thanked everyone for their patience and promised to publish the "
             "final numbers before the end of the month.")
CPU_TASKS = ["Repeat this paragraph exactly:\n\n", "Rewrite this paragraph, replacing "
             "'committee' with 'council':\n\n", "Correct any mistakes in this paragraph and "
             "return it:\n\n"]


class RandomProposer:
    """Drafts that (almost) never match: k random ids (the overhead case)."""

    def __init__(self, vocab: int, seed: int = 0):
        self.rng, self.vocab = random.Random(seed), vocab

    def propose(self, token_ids, k):
        return [self.rng.randrange(self.vocab) for _ in range(k)]


class NoProposer:
    def propose(self, token_ids, k):
        return []


def generate(llm, prompts, max_tokens, spec: bool, drafter, ignore_eos: bool = True):
    """Greedy generation of `prompts`; with the engine's drafter on or off. Returns (outputs,
    seconds, acceptance stats of this run)."""
    from pagedbackend import SamplingParams
    from pagedbackend.spec_decode.drafter import SpecDecodeStats
    eng = llm.engine
    eng.drafter = drafter if spec else None
    if drafter is not None:
        drafter.stats = SpecDecodeStats(accepted_per_pos=[0] * drafter.k)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    eng.timing_summary(reset=True)
    outs, secs = timed(llm.generate, [{"prompt_token_ids": p} for p in prompts], params)
    st = drafter.snapshot() if spec and drafter is not None else None
    eng.drafter = drafter
    return outs, secs, st, eng.timing_summary(reset=True)


def row(name, batch, base, spec, k):
    """base / spec: generate()'s results (outputs, seconds, acceptance stats, step split)."""
    (b_out, b_secs, _, b_split), (s_out, s_secs, st, split) = base, spec
    tokens = sum(len(o.outputs[0].token_ids) for o in s_out)
    same = [o.outputs[0].token_ids for o in b_out] == [o.outputs[0].token_ids for o in s_out]
    # where the first sequence's outputs part (None: they do not)
    first = next((i for i, (x, y) in enumerate(zip(b_out[0].outputs[0].token_ids,
                                                     s_out[0].outputs[0].token_ids)) if x != y),
                 None)
    return {"case": name, "batch": batch, "k": k, "tokens": tokens,
            "base_tok_s": tokens / b_secs, "spec_tok_s": tokens / s_secs,
            "speedup": b_secs / s_secs,
            "acceptance": st.acceptance_rate if st else None,
            "tokens_per_verify": (1 + st.num_accepted_tokens / st.num_drafts)
            if st and st.num_drafts else None, "same_output": same, "first_difference": first,
            # per engine step with speculation: wall, device busy (first upload -> ids out)
            "steps": split.get("steps"), "step_ms": split.get("step_ms"),
            "gpu_busy_ms": split.get("gpu_busy_ms"),
            "base_step_ms": b_split.get("step_ms")}


def repeating(llm, prompts, max_tokens, drafter):
    """Each prompt followed by the model's own greedy answer to it."""
    outs = generate(llm, prompts, max_tokens, False, drafter)[0]
    return [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]


def pyprofile(fn, label: str, top: int = 30) -> None:
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.runcall(fn)
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    stats.print_stats(top)
    print(f"== host profile: {label} ==\n" + buf.getvalue())
    if os.environ.get("OUT"):
        stats.dump_stats(os.path.join(os.environ["OUT"], f"pyprofile-{label}.prof"))


def gpu(a):
    import torch

    from pagedbackend import LLM
    from pagedbackend.spec_decode.drafter import Backoff
    from pagedbackend.spec_decode.ngram import NgramProposer
    model_dir = a.model if os.path.isdir(a.model) else dummy_model_dir(a.model)
    kw = dict(load_format="dummy", max_model_len=4096, num_kv_blocks=a.num_kv_blocks,
              max_num_seqs=64, dtype=a.dtype)
    k = 5
    llm = LLM(model_dir, speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                             "prompt_lookup_min": 1, "prompt_lookup_max": 4},
              **kw)
    ngram = llm.engine.drafter
    rows = []
    vocab = llm.engine.info.vocab_size          # (a tiny test model's is small)
    warm = [[t % vocab for t in p] for p in random_prompts(2, 128, seed=3)]
    generate(llm, warm, 16, False, ngram)
    generate(llm, warm, 16, True, ngram)
    base_prompts = [[t % vocab for t in p] for p in random_prompts(64, 128, seed=11)]
    rep = repeating(llm, base_prompts, a.output_len, ngram)
    # ceiling: batch 1, n-gram on a prompt that repeats
    b = generate(llm, rep[:1], a.output_len, False, ngram)
    s = generate(llm, rep[:1], a.output_len, True, ngram)
    rows.append(row("ceiling-ngram", 1, b, s, k))
    # overhead: drafts never accepted, k = 5 with the backoff (the default: a request whose
    # drafts were all rejected sits out proposal rounds), then k = 5 and k = 1 without it
    # (every round verifies: the cost of a verification against a decode step)
    for kk, backoff in ((5, True), (5, False), (1, False)):
        ngram.proposer, ngram.k = RandomProposer(llm.engine.info.vocab_size), kk
        ngram.backoff = Backoff() if backoff else None
        s = generate(llm, rep[:1], a.output_len, True, ngram)
        rows.append(row("reject-all" + ("" if backoff else "-nobackoff"), 1, b, s, kk))
    if a.pyprofile:
        # where the host time of a step goes, every step verifying 1 + 1 tokens, then without
        # drafts (cProfile; the top functions by cumulative time, the full list under $OUT)
        for spec in (True, False):
            pyprofile(lambda: generate(llm, rep[:1], a.output_len, spec, ngram),
                      "verify" if spec else "decode")
    ngram.backoff = Backoff()
    # a proposer that finds nothing: the cost of the drafter being on (rounds that wait for
    # the step in flight, every drafter.PROBE_EVERY steps)
    ngram.proposer, ngram.k = NoProposer(), k
    s = generate(llm, rep[:1], a.output_len, True, ngram)
    rows.append(row("no-drafts", 1, b, s, k))
    ngram.proposer = NgramProposer(1, 4)
    if a.quick:
        return rows
    # batch sizes: where n-gram speculation stops paying
    for batch in (1, 4, 16, 32, 48, 64):
        b = generate(llm, rep[:batch], a.output_len, False, ngram)
        s = generate(llm, rep[:batch], a.output_len, True, ngram)
        rows.append(row("ngram", batch, b, s, k))
    del llm, ngram
    gc.collect()
    torch.cuda.empty_cache()
    if not a.skip_draft:
        # the draft model = the target (dummy weights from the same seed): acceptance 100%
        llm = LLM(model_dir, speculative_config={"method": "draft_model", "model": model_dir,
                                                 "num_speculative_tokens": k}, **kw)
        d = llm.engine.drafter
        generate(llm, warm, 16, True, d)
        b = generate(llm, rep[:1], a.output_len, False, d)
        s = generate(llm, rep[:1], a.output_len, True, d)
        rows.append(row("draft=target", 1, b, s, k))
    return rows


def cpu(a):
    from pagedbackend import LLM
    from pagedbackend.engine.llm import chat_token_ids
    k = 5
    llm = LLM(a.cpu_model, dtype="float32", max_model_len=2048, num_kv_blocks=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": k,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    d = llm.engine.drafter
    prompts = [chat_token_ids(llm.engine.tokenizer, [{"role": "user", "content": t + PARAGRAPH}])
               for t in CPU_TASKS]
    generate(llm, prompts[:1], 4, False, d)
    rows = []
    for i, p in enumerate(prompts):
        # A-B-A-B, the faster of each: a shared CPU's load moves between runs
        # the answer ends at its EOS (ignore_eos would make it babble past the task)
        runs = [generate(llm, [p], a.output_len, spec, d, ignore_eos=False)
                for spec in (False, True) * 2]
        b = min(runs[0::2], key=lambda r: r[1])
        s = min(runs[1::2], key=lambda r: r[1])
        rows.append(row(f"smollm2-task{i}", 1, b, s, k))
        rows[-1]["answer"] = llm.engine.tokenizer.decode(s[0][0].outputs[0].token_ids)[:40]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="SmolLM2 on the CPU (real weights)")
    ap.add_argument("--model", default="llama-3.1-8b",
                    help="a perf/configs name or a model directory (dummy weights)")
    ap.add_argument("--cpu-model", default=os.path.join(ROOT, "models/smollm2-135m-instruct"))
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-kv-blocks", type=int, default=4096)
    ap.add_argument("--skip-draft", action="store_true")
    ap.add_argument("--dtype", default="bfloat16",
                    help="GPU: the engine's dtype (float32: whether greedy outputs with and "
                         "without speculation part only by bf16 rounding)")
    ap.add_argument("--pyprofile", action="store_true",
                    help="GPU: cProfile of the host side of verification and decode steps")
    ap.add_argument("--quick", action="store_true",
                    help="GPU: only batch 1 (ceiling, reject-all, no-drafts)")
    a = ap.parse_args()
    t0 = time.time()
    rows = cpu(a) if a.cpu else gpu(a)
    name = "smollm2-135m-instruct" if a.cpu else os.path.basename(a.model.rstrip("/")) + (
        "" if a.dtype == "bfloat16" else f"-{a.dtype}")
    write_result("spec_decode", name, {"rows": rows, "seconds": time.time() - t0})
    print_table(rows, f"speculative decoding, {name}")


if __name__ == "__main__":
    main()
