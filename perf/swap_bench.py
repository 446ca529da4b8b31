"""The host KV tier (swap_space), llama-3.1-8b dummy weights, every variant in one process.

    python perf/swap_bench.py [--parts chat,w2] [--tiny]

chat: multi-turn conversations, each a history of --history tokens of its own, then per turn a
user message of --user tokens and an answer of --output tokens, all kept in the next turn's
prompt. Conversations run in groups of --active at a time: a group's turn k is submitted at
once, its turn k + 1 when all have answered. A group's histories do not fit the GPU pool
(--chat-gpu-blocks), so without a host tier every turn prefills its whole history again; with
swap_space=32 (GiB) the evicted blocks wait in host memory and come back as prefix hits.
Reported: TTFT p50/p99 (all turns, and turns 2+), output and prompt tokens/s, host hits.
Goal: p50 TTFT at least 2x lower with the host tier. GPU prefix hits stay near 0 in both runs,
by design of the load: a group comes back in the order it left, so the GPU pool's LRU evicts
most histories before their next turn (a cyclic scan larger than the cache). The few GPU hits
are a group's last finishers and recompute-preempted requests finding their own blocks again;
with a tier, preempted requests swap instead (a swap-in is no prefix lookup) and the evicted
histories come back as host hits.

w2: W2-shaped (random --w2-prompt-token prompts, --w2-output tokens each, ignore_eos, all at once)
with the KV pool at a quarter of what the requests need: preemption on every wave.
recompute (swap_space 0) against swap and auto (swap_space 32). Reported: output tokens/s,
preemptions by mode, blocks copied.

--tiny: a tiny random llama at CPU sizes (checks that the script runs).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time

from common import dummy_model_dir, engine_overrides, print_table, write_result


def tiny_model_dir() -> str:
    from pagedbackend.testing import TINY_CONFIGS
    d = os.path.join(tempfile.gettempdir(), "pagedbackend-dummy", "tiny-llama")
    os.makedirs(d, exist_ok=True)
    cfg = {**TINY_CONFIGS["llama"], "architectures": ["LlamaForCausalLM"],
           "model_type": "llama", "max_position_embeddings": 4096}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def vocab_of(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(min(100, vocab // 2), min(10000, vocab)) for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def free(llm) -> None:
    import torch
    llm.engine.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def chat(make_llm, a, vocab: int, swap_space: float) -> dict:
    from pagedbackend import SamplingParams
    rng = random.Random(0)
    histories = [tokens(rng, a.history, vocab) for _ in range(a.conversations)]
    users = [[tokens(rng, a.user, vocab) for _ in range(a.turns)] for _ in histories]
    params = SamplingParams(temperature=0, max_tokens=a.output, ignore_eos=True)
    llm = make_llm(num_kv_blocks=a.chat_gpu_blocks, swap_space=swap_space)
    llm.generate([{"prompt_token_ids": tokens(rng, 64, vocab)}], params, use_tqdm=False)
    ttft, later, out_toks, prompt_toks = [], [], 0, 0
    t0 = time.perf_counter()
    for g in range(0, a.conversations, a.active):
        group = range(g, min(g + a.active, a.conversations))
        ctx = {c: list(histories[c]) for c in group}
        for turn in range(a.turns):
            prompts = {c: ctx[c] + users[c][turn] for c in group}
            outs = llm.generate([{"prompt_token_ids": prompts[c]} for c in group], params,
                                use_tqdm=False)
            for c, o in zip(group, outs):
                t = o.first_token_time - o.arrival_time
                ttft.append(t)
                if turn:
                    later.append(t)
                ctx[c] = prompts[c] + o.outputs[0].token_ids
                out_toks += len(o.outputs[0].token_ids)
                prompt_toks += len(prompts[c])
    secs = time.perf_counter() - t0
    st = llm.engine.stats()
    free(llm)
    return {"part": "chat", "swap_space": swap_space, "seconds": secs,
            "ttft_p50_ms": pct(ttft, 0.5) * 1e3, "ttft_p99_ms": pct(ttft, 0.99) * 1e3,
            "later_ttft_p50_ms": pct(later, 0.5) * 1e3, "later_ttft_p99_ms": pct(later, 0.99) * 1e3,
            "output_tokens_per_s": out_toks / secs, "prompt_tokens_per_s": prompt_toks / secs,
            "gpu_prefix_hits": st.prefix_cache_hits, "host_prefix_hits": st.cpu_prefix_cache_hits,
            "swap_out_blocks": st.swap_out_blocks, "swap_in_blocks": st.swap_in_blocks,
            "preemptions": st.num_preemptions}


def w2(make_llm, a, vocab: int, mode: str) -> dict:
    from pagedbackend import SamplingParams
    rng = random.Random(1)
    prompts = [{"prompt_token_ids": tokens(rng, a.w2_prompt, vocab)} for _ in range(a.w2_requests)]
    bs = a.block_size
    need = a.w2_requests * -(-(a.w2_prompt + a.w2_output) // bs)
    pool = max(-(-(a.w2_prompt + a.w2_output) // bs), need // 4)
    swap_space = 0 if mode == "recompute" else a.swap_space
    llm = make_llm(num_kv_blocks=pool, swap_space=swap_space,
                   preemption_mode=None if mode == "recompute" else mode)
    params = SamplingParams(temperature=0, max_tokens=a.w2_output, ignore_eos=True)
    llm.generate(prompts[:2], params.clone(max_tokens=8), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    secs = time.perf_counter() - t0
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    assert toks == a.w2_requests * a.w2_output, toks
    st = llm.engine.stats()
    free(llm)
    return {"part": "w2", "mode": mode, "swap_space": swap_space, "kv_blocks": pool,
            "blocks_needed": need, "seconds": secs, "output_tokens_per_s": toks / secs,
            "preemptions": st.num_preemptions, "preempted_swap": st.preemptions_swap,
            "preempted_recompute": st.preemptions_recompute if swap_space else
            st.num_preemptions, "swap_out_blocks": st.swap_out_blocks,
            "swap_in_blocks": st.swap_in_blocks}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--parts", default="chat,w2")
    ap.add_argument("--tiny", action="store_true", help="a tiny random llama, CPU sizes")
    ap.add_argument("--swap-space", type=float, default=32.0, help="GiB of the host tier")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=128)
    ap.add_argument("--active", type=int, default=32, help="conversations at a time")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--history", type=int, default=2048)
    ap.add_argument("--user", type=int, default=64)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--chat-gpu-blocks", type=int, default=4096,
                    help="the GPU pool for chat (4096 x 16 tokens: 65k of a group's ~88k)")
    ap.add_argument("--w2-requests", type=int, default=256)
    ap.add_argument("--w2-prompt", type=int, default=128)
    ap.add_argument("--w2-output", type=int, default=512)
    ap.add_argument("--w2-modes", default="recompute,swap,auto")
    a = ap.parse_args()
    if a.tiny:
        a.model = "tiny-llama"
        a.swap_space = min(a.swap_space, 0.01)
        a.conversations, a.active, a.turns, a.history, a.user, a.output = 6, 3, 3, 48, 8, 4
        a.chat_gpu_blocks = 10
        a.w2_requests, a.w2_prompt, a.w2_output = 12, 16, 24
    model_dir = tiny_model_dir() if a.tiny else dummy_model_dir(a.model)
    vocab = vocab_of(model_dir)
    from pagedbackend import LLM

    def make_llm(**kw):
        return LLM(model_dir, load_format="dummy", max_model_len=4096 if not a.tiny else 128,
                   block_size=a.block_size, **engine_overrides(), **kw)
    rows = []
    parts = a.parts.split(",")
    if "chat" in parts:
        chat_rows = [chat(make_llm, a, vocab, s) for s in (0.0, a.swap_space)]
        base, tier = chat_rows
        speedup = base["ttft_p50_ms"] / tier["ttft_p50_ms"]
        save = (lambda *x: None) if a.tiny else write_result     # a check, not a measurement
        save("swap-chat", a.model, {"output_tokens_per_s": tier["output_tokens_per_s"],
                                             "ttft_p50_speedup": speedup, "rows": chat_rows,
                                             "args": vars(a)})
        rows += chat_rows
        print(f"chat: p50 TTFT {speedup:.2f}x lower with swap_space={a.swap_space:g} "
              f"(goal >= 2x)")
    if "w2" in parts:
        w2_rows = [w2(make_llm, a, vocab, m) for m in a.w2_modes.split(",")]
        save = (lambda *x: None) if a.tiny else write_result
        save("swap-w2", a.model, {"output_tokens_per_s": max(
            r["output_tokens_per_s"] for r in w2_rows), "rows": w2_rows, "args": vars(a)})
        rows += w2_rows
    for part in ("chat", "w2"):
        sel = [r for r in rows if r["part"] == part]
        keys = sorted({k for r in sel for k in r}, key=lambda k: list(sel[0]).index(k)
                      if k in sel[0] else 99)
        print_table([{k: r.get(k, "") for k in keys} for r in sel], f"swap_space: {part}")


if __name__ == "__main__":
    main()
