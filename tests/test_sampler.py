"""Sampler behaviour against plain reference formulas, on fresh random logits every run."""
import math

import pytest
import torch

from pagedbackend.layers import sampler as sampler_mod
from pagedbackend.layers.sampler import Sampler, SamplerOutput
from pagedbackend.layers.sampling_metadata import SamplingMetadata
from pagedbackend.sampling_params import SamplingParams

V = 512
CPU = torch.device("cpu")


def build(params, logits_rows=None, prompts=None, outputs=None, gens=None, stop_ids=None,
          vocab=V):
    n = len(params)
    return SamplingMetadata.build(
        params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)],
        gens or [None] * n, stop_ids or [[] for _ in range(n)], vocab, CPU)


def rand_logits(b, v=V, scale=3.0):
    return torch.randn(b, v) * scale


def gen(seed):
    return torch.Generator(device="cpu").manual_seed(seed)


def run(logits, meta) -> SamplerOutput:
    before = logits.clone()
    out = Sampler()(logits, meta)
    assert torch.equal(logits, before), "the sampler must not modify its input"
    assert out.sampled_token_ids.dtype == torch.long and out.sampled_token_ids.shape == (len(logits),)
    return out


# ---- reference formulas (float64, one row at a time) ----

def ref_masked(row, p: SamplingParams):
    """Allowed-token mask and a per-token 'distance from the decision boundary'."""
    l = row.double() / p.temperature
    keep = torch.ones_like(l, dtype=torch.bool)
    margin = torch.full_like(l, math.inf)
    if 0 < p.top_k < len(l):
        kth = l.sort(descending=True).values[p.top_k - 1]
        keep &= l >= kth
    if p.top_p < 1.0:
        probs = torch.softmax(l.masked_fill(~keep, -math.inf), dim=-1)
        order = probs.argsort(descending=True)
        mass_before = torch.zeros_like(probs)
        mass_before[order] = probs[order].cumsum(0) - probs[order]
        keep &= mass_before < p.top_p
        margin = torch.minimum(margin, (mass_before - p.top_p).abs())
    if p.min_p > 0.0:
        probs = torch.softmax(l.masked_fill(~keep, -math.inf), dim=-1)
        ratio = probs / probs.max()
        keep &= ratio >= p.min_p
        margin = torch.minimum(margin, (ratio - p.min_p).abs())
    return keep, margin


def ref_penalised(row, p: SamplingParams, prompt, output):
    l = row.double().clone()
    seen = set(prompt) | set(output)
    for t in seen:
        if p.repetition_penalty != 1.0:
            l[t] = l[t] / p.repetition_penalty if l[t] > 0 else l[t] * p.repetition_penalty
    for t in set(output):
        l[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return l


# ---- tests ----

MASK_PARAMS = [
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_k=40),
    SamplingParams(temperature=1.0),                       # nothing on, next to rows that are
    SamplingParams(temperature=0.9, top_p=0.8),
    SamplingParams(temperature=1.1, top_k=30, top_p=0.5),
    SamplingParams(temperature=0.6, min_p=0.05),
    SamplingParams(temperature=1.0, top_k=100, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=2.0, top_k=V + 10),         # k past the vocabulary: off
]


@pytest.mark.parametrize("rows", [[0, 1, 2], [2, 3], [5, 2], list(range(len(MASK_PARAMS)))],
                         ids=["top_k_only", "top_p_only", "min_p_only", "all"])
def test_masks_match_reference(rows):
    params = [MASK_PARAMS[i] for i in rows]
    logits = rand_logits(len(params))
    meta = build(params)
    got = sampler_mod._sampling_logits(logits.clone(), meta)
    for i, p in enumerate(params):
        keep, margin = ref_masked(logits[i], p)
        clear = margin > 1e-4          # float32 vs float64 may disagree right on the boundary
        assert torch.equal(torch.isfinite(got[i])[clear], keep[clear]), p
        assert keep.sum() >= 1
    # Black box: every sample lands in the allowed set.
    many = logits.repeat(200, 1)
    out = run(many, build(params * 200)).sampled_token_ids.view(200, len(params))
    for i, p in enumerate(params):
        keep, _ = ref_masked(logits[i], p)
        assert keep[out[:, i]].all(), p


def test_greedy_top_k_1_and_min_p_1_equal_argmax():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=1),
              SamplingParams(temperature=1.0, min_p=1.0),          # goes through the sampling path
              SamplingParams(temperature=0.0, seed=3), SamplingParams(temperature=1e-7)]
    logits = rand_logits(len(params))
    gens = [None, None, None, gen(3), None]
    for _ in range(3):
        out = run(logits, build(params, gens=gens))
        assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert build(params).num_random == 1


def test_penalties_match_reference():
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.7),
              SamplingParams(temperature=0.0, repetition_penalty=0.6, frequency_penalty=0.4),
              SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=-0.7),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, presence_penalty=-1.0, repetition_penalty=1.2)]
    g = torch.Generator().manual_seed(torch.seed())
    prompts = [torch.randint(0, V, (int(torch.randint(1, 40, ())),), generator=g).tolist()
               for _ in params]
    # Outputs repeat tokens so counts > 1 occur.
    outputs = [torch.randint(0, 30, (int(torch.randint(0, 25, ())),), generator=g).tolist()
               for _ in params]
    logits = rand_logits(len(params))
    meta = build(params, prompts=prompts, outputs=outputs)
    got = sampler_mod._apply_penalties(logits, meta)
    ref = torch.stack([ref_penalised(logits[i], p, prompts[i], outputs[i])
                       for i, p in enumerate(params)])
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    out = run(logits, meta)
    assert torch.equal(out.sampled_token_ids, ref.argmax(-1))


def test_no_penalty_rows_skip_the_work():
    meta = build([SamplingParams(temperature=0.0), SamplingParams()],
                 prompts=[[1, 2, 3], [4]], outputs=[[5], [6]])
    assert meta.output_counts is None and meta.seen_mask is None
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.temperature is None and meta.banned_rows is None
    assert meta.bias_rows is None and meta.allowed_mask is None


def test_min_tokens_masks_stop_ids_until_reached():
    logits = rand_logits(3)
    top2 = logits.topk(2, dim=-1).indices
    params = [SamplingParams(temperature=0.0, min_tokens=4),
              SamplingParams(temperature=0.0, min_tokens=2),     # already reached: no mask
              SamplingParams(temperature=1.0, min_tokens=5)]
    stop = [top2[0].tolist() + [V + 3],                          # out-of-vocab id is ignored
            [int(top2[1, 0])], [int(top2[2, 0])]]
    outputs = [[7, 8], [7, 8, 9], []]
    out = run(logits, build(params, outputs=outputs, stop_ids=stop))
    masked0 = logits[0].clone()
    masked0[top2[0]] = -math.inf
    assert out.sampled_token_ids[0] == masked0.argmax()
    assert out.sampled_token_ids[1] == top2[1, 0]
    # A sampled row never draws a forbidden id, even the most likely one.
    many = run(logits[2:].repeat(300, 1),
               build(params[2:] * 300, outputs=[[]] * 300, stop_ids=[stop[2]] * 300))
    assert not (many.sampled_token_ids == top2[2, 0]).any()


def test_samples_follow_the_distribution():
    v = 8
    logits = torch.randn(1, v)
    p = SamplingParams(temperature=0.8, top_k=6)
    keep, _ = ref_masked(logits[0], p)
    expected = torch.softmax((logits[0].double() / 0.8).masked_fill(~keep, -math.inf), -1)
    n_batched, n_seeded = 6000, 600
    base = torch.seed()
    params = [p.clone(seed=None)] * n_batched + [p.clone(seed=base + i) for i in range(n_seeded)]
    gens = [None] * n_batched + [gen(base + i) for i in range(n_seeded)]
    out = run(logits.repeat(len(params), 1), build(params, gens=gens, vocab=v))
    for ids, n in ((out.sampled_token_ids[:n_batched], n_batched),
                   (out.sampled_token_ids[n_batched:], n_seeded)):
        counts = torch.bincount(ids, minlength=v).double()
        assert counts[~keep].sum() == 0
        e = expected[keep] * n
        chi2 = ((counts[keep] - e) ** 2 / e.clamp_min(1e-3)).sum().item()
        assert chi2 < 45, (chi2, counts, expected * n)   # 5 dof: p ~ 1e-8 of a false alarm


def test_seeded_rows_do_not_depend_on_batch():
    seed = int(torch.randint(0, 2**62, ()))
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=seed)
    steps = [torch.randn(V) * 0.5 for _ in range(6)]       # flat: the noise decides

    def trajectory(position, neighbours, neighbour_gens):
        g = gen(seed)
        got = []
        for row in steps:
            logits = rand_logits(len(neighbours) + 1)
            logits[position] = row
            params = list(neighbours)
            params.insert(position, mine)
            gens = list(neighbour_gens)
            gens.insert(position, g)
            got.append(int(run(logits, build(params, gens=gens)).sampled_token_ids[position]))
        return got

    alone = trajectory(0, [], [])
    a = trajectory(2, [SamplingParams(temperature=0.0), SamplingParams(top_k=3),
                       SamplingParams(seed=1, temperature=0.5), SamplingParams(min_p=0.1)],
                   [None, None, gen(1), None])
    b = trajectory(1, [SamplingParams(repetition_penalty=1.3)], [None])
    assert alone == a == b
    other = SamplingParams(temperature=1.0, top_p=0.95, seed=seed + 1)
    assert trajectory_of(other, steps) != alone


def trajectory_of(p, steps):
    g = gen(p.seed)
    return [int(run(row[None], build([p], gens=[g])).sampled_token_ids[0]) for row in steps]


def test_unseeded_samples_differ_across_draws():
    logits = torch.zeros(8, V)
    meta = build([SamplingParams()] * 8)
    a, b = run(logits, meta).sampled_token_ids, run(logits, meta).sampled_token_ids
    assert not torch.equal(a, b)


def test_logprobs_are_raw_log_softmax_with_top_k():
    params = [SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0, presence_penalty=2.0),
              SamplingParams(top_k=10, logprobs=5)]
    logits = rand_logits(len(params))
    out = run(logits, build(params, prompts=[[1, 2]] * 4, outputs=[[3, 4, 4]] * 4))
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == (4, 6)
    raw = torch.log_softmax(logits.double(), -1)
    sampled = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs.double(), raw.gather(1, lp.token_ids),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(lp.token_ids[:, 1:], raw.topk(5, dim=-1).indices)
    assert (lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:]).all()
    assert torch.equal(lp.token_ids[:, 1], logits.argmax(-1))
    rows = lp.tolists()
    assert rows[1] is None
    assert list(rows[2]) == [int(sampled[2])]
    for i, k in ((0, 3), (3, 5)):
        top = raw[i].topk(k).indices.tolist()
        assert list(rows[i]) == list(dict.fromkeys([int(sampled[i])] + top))
        for t, v in rows[i].items():
            assert v == pytest.approx(raw[i, t].item(), abs=1e-5)
    assert run(logits, build([SamplingParams()] * 4)).logprobs is None


def test_bad_shapes_are_reported():
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingMetadata.build([SamplingParams()], [], [[]], [None], [[]], V, CPU)
    with pytest.raises(ValueError, match="does not match"):
        Sampler()(rand_logits(2), build([SamplingParams()]))


# ---- logit_bias, allowed_token_ids, bad_words --------------------------------------------
def test_logit_bias_is_added_before_sampling_and_logprobs_stay_raw():
    logits = rand_logits(3)
    bias = {int(t): float(b) for t, b in zip(torch.randperm(V)[:5], (7.5, -3.0, 100, -100, 2))}
    params = [SamplingParams(temperature=0.0, logit_bias=bias, logprobs=2),
              SamplingParams(temperature=0.9, seed=11, logit_bias=bias),
              SamplingParams(temperature=0.0)]
    biased = logits.clone()
    for t, b in bias.items():
        biased[:2, t] += b
    out = run(logits, build(params, gens=[None, gen(4), None]))
    # the same draws as from logits that carry the bias already (same seed for the sampled row)
    ref = run(biased, build([p.clone(logit_bias=None) for p in params],
                            gens=[None, gen(4), None]))
    assert torch.equal(out.sampled_token_ids, ref.sampled_token_ids)
    assert out.sampled_token_ids[0] == biased[0].argmax()
    assert out.sampled_token_ids[2] == logits[2].argmax()            # a row without a bias
    raw = torch.log_softmax(logits[0].double(), -1)
    lp = out.logprobs.tolists()[0]
    for t, v in lp.items():
        assert v == pytest.approx(raw[t].item(), abs=1e-5)


def test_allowed_token_ids_restrict_only_their_rows():
    # logits of scale 1, not 3: at 3 one of the 7 allowed tokens often held nearly all of row
    # 1's probability, and 40 draws gave it alone in ~1.2% of runs (a fresh-clone CI did)
    logits = rand_logits(4, scale=1.0)
    allowed = sorted(torch.randperm(V)[:7].tolist())
    params = [SamplingParams(temperature=0.0, allowed_token_ids=allowed),
              SamplingParams(temperature=1.5, allowed_token_ids=allowed),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.5, seed=3)]
    meta = build(params, gens=[None, None, None, gen(3)])
    assert meta.allowed_mask.sum(-1).tolist() == [7, 7, V, V]
    out = run(logits, meta)
    assert out.sampled_token_ids[0] == allowed[int(logits[0, allowed].argmax())]
    assert out.sampled_token_ids[2] == logits[2].argmax()
    alone = run(logits[3:], build(params[3:], gens=[gen(3)]))
    assert out.sampled_token_ids[3] == alone.sampled_token_ids[0]     # the same seeded draw
    drawn = {int(run(logits, build(params, gens=[None, None, None, gen(3)]))
                 .sampled_token_ids[1]) for _ in range(40)}
    assert drawn <= set(allowed) and len(drawn) > 1


def bad_words_meta(output, words):
    return SamplingMetadata.build([SamplingParams(temperature=0.0)], [[]], [output], [None],
                                  [[]], V, CPU, bad_words=[words])


def test_bad_words_ban_a_word_s_last_token_only_after_the_rest_of_it():
    logits = rand_logits(1)
    best, second, third = logits[0].argsort(descending=True)[:3].tolist()
    # a one-token word: banned at every step
    assert run(logits, bad_words_meta([9], [[best]])).sampled_token_ids[0] == second
    # a word [42, best]: its last token is banned only right after 42
    words = [[42, best], [7, 42, second]]
    assert run(logits, bad_words_meta([5, 7], words)).sampled_token_ids[0] == best
    assert run(logits, bad_words_meta([42, 5], words)).sampled_token_ids[0] == best
    after_42 = bad_words_meta([5, 42], words)
    assert after_42.banned_ids.tolist() == [best]
    assert run(logits, after_42).sampled_token_ids[0] == second
    # after ... 7, 42 both words are one token short of complete: both last tokens banned
    both = bad_words_meta([1, 7, 42], words)
    assert both.banned_ids.tolist() == [best, second]
    assert run(logits, both).sampled_token_ids[0] == third
    # a word longer than the output so far bans nothing
    assert bad_words_meta([42], [[3, 42, best]]).banned_rows is None


class FakeGrammar:
    """The GrammarState interface with a fixed set of allowed tokens."""

    def __init__(self, allowed):
        self.allowed = allowed

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for t in self.allowed:
            word = bitmask[row, t // 32].item() | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word


def test_grammar_rows_sample_only_what_the_grammar_allows():
    logits = rand_logits(3)
    allowed = sorted(torch.randperm(V)[:5].tolist()) + [V - 1, 31, 32]   # word edges too
    g = FakeGrammar(allowed)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=2.0, allowed_token_ids=allowed[:3])]
    meta = SamplingMetadata.build(params, [[]] * 3, [[]] * 3, [None] * 3, [[]] * 3, V, CPU,
                                  grammars=[g, None, g])
    assert meta.allowed_mask[0].nonzero().flatten().tolist() == sorted(set(allowed))
    assert meta.allowed_mask[1].all()
    # a grammar and allowed_token_ids together: both hold
    assert meta.allowed_mask[2].nonzero().flatten().tolist() == sorted(allowed[:3])
    out = run(logits, meta)
    assert out.sampled_token_ids[0] == max(allowed, key=lambda t: logits[0, t])
    assert out.sampled_token_ids[1] == logits[1].argmax()
    assert int(out.sampled_token_ids[2]) in allowed[:3]


def test_bitmask_unpacking_matches_xgrammar():
    xgr = pytest.importorskip("xgrammar")
    from pagedbackend.layers.token_controls import unpack_bitmask
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, (V + 31) // 32), dtype=torch.int32)
    logits = rand_logits(3)
    ref = logits.clone()
    xgr.apply_token_bitmask_inplace(ref, bitmask)
    assert torch.equal(logits.masked_fill(~unpack_bitmask(bitmask, V), -math.inf), ref)
