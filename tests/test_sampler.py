"""The sampler (minivllm/sample/, chapter 06) against the formulas, written out plainly here.

Every reference below handles one row at a time in float64, in the order the sampler uses
(vLLM v1's): min_tokens, penalties, temperature, min-p, top-k, top-p. Where float32 (the
sampler) and float64 (the reference) could round a token to different sides of a cut-off,
the reference reports it and the example is skipped: that is rounding, not a bug.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minivllm.sample import Sampler, build_sampling_metadata, make_logprobs_dicts
from minivllm.sample.sampler import apply_min_p, apply_penalties, apply_top_k_top_p
from minivllm.sampling_params import SamplingParams

NEAR = 1e-5  # cut-offs closer than this to a token are "float32 rounding territory"
logit_values = st.one_of(st.integers(-6, 6).map(float), st.floats(-8, 8))  # integers make ties


def rows(min_vocab: int = 2, max_vocab: int = 12, max_rows: int = 4):
    """B rows of V logits each (V and B drawn too)."""
    row = lambda v: st.lists(logit_values, min_size=v, max_size=v)  # noqa: E731
    return st.integers(min_vocab, max_vocab).flatmap(
        lambda v: st.lists(row(v), min_size=1, max_size=max_rows)
    )


# -- the reference, one row at a time ------------------------------------------------------


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def ref_min_p(x: np.ndarray, min_p: float) -> tuple[np.ndarray, bool]:
    probs = softmax(x)
    cut = min_p * probs.max()
    near = min_p > 0 and bool(np.any(np.abs(probs - cut) < NEAR * cut))
    return np.where(probs < cut, -np.inf, x), near


def ref_top_k(x: np.ndarray, k: int) -> tuple[np.ndarray, bool]:
    if k == 0 or k >= len(x):
        return x, False
    kth = sorted(x, reverse=True)[k - 1]  # every token tied with the k-th is kept
    with np.errstate(invalid="ignore"):  # -inf - -inf: a token masked earlier is not near
        near = bool(np.any((np.abs(x - kth) < NEAR) & (x != kth)))
    return np.where(x < kth, -np.inf, x), near


def ref_top_p(x: np.ndarray, p: float) -> tuple[np.ndarray, bool]:
    """Walk down from the most likely token until the mass reaches p; keep those, plus any
    token tied with the last one."""
    if p >= 1.0:
        return x, False
    probs, mass, near = softmax(x), 0.0, False
    for token in sorted(range(len(x)), key=lambda t: -x[t]):
        mass += probs[token]
        near |= abs(mass - p) < NEAR
        if mass >= p:
            last = x[token]
            break
    else:  # rounding kept the total just below p: keep everything, and call it too close
        return x, True
    with np.errstate(invalid="ignore"):
        near |= bool(np.any((np.abs(x - last) < NEAR) & (x != last)))
    return np.where(x < last, -np.inf, x), near


def ref_penalties(x, prompt, output, repetition, presence, frequency) -> np.ndarray:
    x = x.copy()
    for token in range(len(x)):
        if token in prompt or token in output:  # repetition: prompt and output
            x[token] = x[token] / repetition if x[token] > 0 else x[token] * repetition
        count = output.count(token)  # frequency and presence: output only
        x[token] -= frequency * count + presence * (count > 0)
    return x


def ref_distribution(
    logits: list[float], params: SamplingParams, prompt=(), output=()
) -> tuple[np.ndarray, bool]:
    """The probability of each token for one row, and whether a cut was too close to call."""
    x = np.array(logits, dtype=np.float64)
    if len(output) < params.min_tokens:
        x[list(params.all_stop_token_ids)] = -np.inf
    x = ref_penalties(x, list(prompt), list(output), params.repetition_penalty,
                      params.presence_penalty, params.frequency_penalty)  # fmt: skip
    if params.temperature < 1e-5:
        top_two = np.sort(x)[-2:]
        return np.eye(len(x))[int(np.argmax(x))], bool(top_two[1] - top_two[0] < NEAR)
    x = x / params.temperature
    x, near_min_p = ref_min_p(x, params.min_p)
    x, near_k = ref_top_k(x, params.top_k)
    x, near_p = ref_top_p(x, params.top_p)
    return softmax(x), near_min_p or near_k or near_p


def metadata(params, prompts=None, outputs=None, generators=None):
    n = len(params)
    return build_sampling_metadata(
        params, prompts or [[] for _ in range(n)], outputs or [[] for _ in range(n)],
        generators or [None] * n, torch.device("cpu"),
    )  # fmt: skip


# -- each transformation against its formula -------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(logits=rows(), data=st.data())
def test_top_k_and_top_p_mask_what_the_formulas_mask(logits, data):
    vocab = len(logits[0])
    ks = data.draw(st.lists(st.integers(0, vocab + 1), min_size=len(logits), max_size=len(logits)))
    ps = data.draw(st.lists(st.floats(0.05, 1.0), min_size=len(logits), max_size=len(logits)))
    expected, near = [], False
    for row, k, p in zip(logits, ks, ps):
        x, near_k = ref_top_k(np.array(row), k)
        x, near_p = ref_top_p(x, p)
        expected.append(np.isinf(x))
        near |= near_k or near_p
    assume(not near)
    masked = apply_top_k_top_p(torch.tensor(logits), torch.tensor(ks), torch.tensor(ps))
    assert np.array_equal(torch.isinf(masked).numpy(), np.array(expected)), (
        f"top_k={ks} top_p={ps}: masked {torch.isinf(masked).tolist()}, want {expected}"
    )


@settings(max_examples=40, deadline=None)
@given(logits=rows(), data=st.data())
def test_min_p_masks_tokens_below_min_p_times_the_top_probability(logits, data):
    min_ps = data.draw(st.lists(st.floats(0.0, 1.0), min_size=len(logits), max_size=len(logits)))
    results = [ref_min_p(np.array(row), m) for row, m in zip(logits, min_ps)]
    assume(not any(near for _, near in results))
    masked = apply_min_p(torch.tensor(logits), torch.tensor(min_ps))
    expected = np.array([np.isinf(x) for x, _ in results])
    assert np.array_equal(torch.isinf(masked).numpy(), expected), f"min_p={min_ps}"


@settings(max_examples=40, deadline=None)
@given(logits=rows(), data=st.data())
def test_penalties_follow_the_hf_and_openai_formulas(logits, data):
    n, vocab = len(logits), len(logits[0])
    tokens = st.lists(st.integers(0, vocab - 1), max_size=8)
    prompts = data.draw(st.lists(tokens, min_size=n, max_size=n))
    outputs = data.draw(st.lists(tokens, min_size=n, max_size=n))
    rep = data.draw(st.lists(st.floats(0.5, 2.0), min_size=n, max_size=n))
    pres = data.draw(st.lists(st.floats(-2.0, 2.0), min_size=n, max_size=n))
    freq = data.draw(st.lists(st.floats(-2.0, 2.0), min_size=n, max_size=n))
    got = apply_penalties(torch.tensor(logits), prompts, outputs, torch.tensor(rep),
                          torch.tensor(pres), torch.tensor(freq))  # fmt: skip
    want = [
        ref_penalties(np.array(x), *row_args)
        for x, *row_args in zip(logits, prompts, outputs, rep, pres, freq)
    ]
    # float32 arithmetic on values below ~40 in magnitude: errors stay under 1e-4.
    np.testing.assert_allclose(got.numpy(), np.array(want), atol=1e-4, err_msg="penalized logits")


def test_min_tokens_blocks_stop_tokens_until_enough_tokens_were_generated():
    eos, vocab = 3, 6
    logits = torch.zeros(4, vocab)
    logits[:, eos] = 20.0  # the model is sure it is done: eos has ~all the mass
    params = [SamplingParams(temperature=t, min_tokens=2) for t in (0.0, 0.0, 1.0, 1.0)]
    for p in params:
        p.all_stop_token_ids = {eos}
    outputs = [[0], [0, 0], [0], [0, 0]]  # rows 0 and 2 still owe a token
    sampled = Sampler()(logits, metadata(params, outputs=outputs)).sampled_token_ids.tolist()
    assert sampled[0] != eos and sampled[2] != eos, f"eos sampled before min_tokens: {sampled}"
    assert sampled[1] == eos and sampled[3] == eos, f"eos allowed after min_tokens: {sampled}"


# -- the sampler end to end -----------------------------------------------------------------

random_params = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
    top_k=st.integers(0, 6),
    top_p=st.sampled_from([0.3, 0.7, 0.9, 1.0]),
    min_p=st.sampled_from([0.0, 0.1, 0.5]),
    repetition_penalty=st.sampled_from([1.0, 1.3]),
    presence_penalty=st.sampled_from([0.0, 0.5]),
    frequency_penalty=st.sampled_from([0.0, -0.5]),
)


@settings(max_examples=60, deadline=None)
@given(logits=rows(min_vocab=3), data=st.data())
def test_every_sampled_token_is_allowed_and_greedy_rows_take_the_argmax(logits, data):
    n, vocab = len(logits), len(logits[0])
    params = data.draw(st.lists(random_params, min_size=n, max_size=n))
    output = st.lists(st.integers(0, vocab - 1), max_size=4)
    outputs = data.draw(st.lists(output, min_size=n, max_size=n))
    refs = [ref_distribution(row, p, output=o) for row, p, o in zip(logits, params, outputs)]
    assume(not any(near for _, near in refs))
    sampled = Sampler()(torch.tensor(logits), metadata(params, outputs=outputs)).sampled_token_ids
    for row, (token, (probs, _)) in enumerate(zip(sampled.tolist(), refs)):
        assert probs[token] > 0, f"row {row} sampled masked token {token}; allowed: {probs > 0}"
        if params[row].temperature == 0.0:
            assert probs[token] == 1.0, f"greedy row {row} must take the argmax, got {token}"


def test_samples_follow_softmax_of_the_masked_logits():
    """40,000 draws of one row (batched) against the reference distribution.

    Tolerance: a token of probability q appears a Binomial(N, q) number of times, so its
    empirical frequency has standard deviation sqrt(q(1-q)/N) <= 0.5/sqrt(40000) = 0.0025.
    We allow 5 standard deviations per token: a correct sampler fails with probability
    < 1e-6 per token (and the seed is fixed, so the test is deterministic). A wrong mask or a
    wrong temperature moves some token by far more -- checked below for the mask order.
    """
    logits = [2.0, 1.6, 1.2, 0.9, 0.5, 0.0, -0.5, -3.0]
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.815, min_p=0.1)
    expected, near = ref_distribution(logits, params)
    assert not near and (expected == 0).sum() >= 3, "premise: the masks cut several tokens"
    # min-p before top-p (vLLM v1) and after it (HF) give different answers here:
    hf_order, _ = ref_top_p(ref_top_k(np.array(logits) / 0.8, 6)[0], 0.815)
    hf_expected = softmax(ref_min_p(hf_order, 0.1)[0])
    assert np.abs(hf_expected - expected).max() > 0.05, "premise: the test pins the mask order"

    n = 40_000
    torch.manual_seed(0)
    out = Sampler()(torch.tensor([logits] * n), metadata([params] * n))
    freq = np.bincount(out.sampled_token_ids.numpy(), minlength=len(logits)) / n
    tolerance = 5 * np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(freq - expected) <= tolerance), (
        f"empirical {np.round(freq, 4)} vs softmax of the masked logits {np.round(expected, 4)}"
    )


def _run_seeded(position: int, batch_size: int, steps_logits: torch.Tensor, seed: int = 1234):
    """Sample `steps` tokens for a seeded request at `position` in a batch of others."""
    params = [SamplingParams(temperature=1.0) for _ in range(batch_size)]
    params[position] = SamplingParams(temperature=1.0, seed=seed)
    gens = [None] * batch_size
    gens[position] = torch.Generator().manual_seed(seed)
    if batch_size > 1:  # another seeded request next to ours
        other = (position + 1) % batch_size
        params[other], gens[other] = SamplingParams(seed=7), torch.Generator().manual_seed(7)
    tokens = []
    for logits in steps_logits:
        batch = logits.expand(batch_size, -1)
        out = Sampler()(batch, metadata(params, generators=gens))
        tokens.append(out.sampled_token_ids[position].item())
    return tokens


@pytest.mark.parametrize("position, batch_size", [(0, 3), (2, 3), (1, 4), (3, 4)])
def test_a_seeded_request_samples_the_same_tokens_whatever_the_batch(position, batch_size):
    steps_logits = torch.randn(12, 50, generator=torch.Generator().manual_seed(0))
    alone = _run_seeded(0, 1, steps_logits)
    assert _run_seeded(position, batch_size, steps_logits) == alone, (
        "a seeded row must draw its noise only from its own generator"
    )
    # 50 tokens with standard-normal logits: two seeds agreeing on 12 draws is a < 1e-10 event.
    assert _run_seeded(0, 1, steps_logits, seed=4321) != alone, "the seed must matter"


# -- logprobs ----------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(logits=rows(min_vocab=4), data=st.data())
def test_logprobs_and_ranks_come_from_the_raw_logits(logits, data):
    n = len(logits)
    params = data.draw(st.lists(random_params, min_size=n, max_size=n))
    for p, k in zip(params, data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))):
        p.logprobs = k
    raw = torch.tensor(logits)
    out = Sampler()(raw, metadata(params, outputs=[[0, 1]] * n))
    assert torch.equal(raw, torch.tensor(logits)), "the sampler must not modify its input"
    want = torch.log_softmax(raw.double(), dim=-1)  # raw: no penalties, no temperature
    num = max(p.logprobs for p in params)
    assert out.logprobs.shape == (n, num + 1), "columns: the sampled token, then the top-N"
    assert torch.equal(out.logprob_token_ids[:, 0], out.sampled_token_ids)
    # log_softmax in float32 of logits below 10 in magnitude: error ~1e-6, allow 1e-5.
    got_lp = out.logprobs.double()
    assert torch.allclose(got_lp, want.gather(1, out.logprob_token_ids), atol=1e-5)
    top = want.topk(num, dim=-1).values
    assert torch.allclose(got_lp[:, 1:], top, atol=1e-5), "top-N by raw logprob, best first"
    for row, token in enumerate(out.sampled_token_ids.tolist()):
        gaps = (raw[row] - raw[row, token]).abs()
        assume(not torch.any((gaps > 0) & (gaps < 1e-4)))  # float32 could round these to a tie
        rank = 1 + int((raw[row] > raw[row, token]).sum())  # strictly better tokens
        assert out.sampled_token_ranks[row].item() == rank, f"row {row}: rank of token {token}"


def test_logprobs_dict_lists_the_sampled_token_first_and_each_token_once():
    # The sampled token 5 ties with token 2 for the best logprob: its rank is 1 (no token is
    # strictly better), although topk happened to list it second.
    ids, lps = [5, 2, 5, 9], [-0.5, -0.5, -0.5, -2.0]
    result = make_logprobs_dicts(ids, lps, 1, num_logprobs=3, decode=lambda t: f"<{t}>")
    assert list(result) == [5, 2, 9], "sampled first, then the top tokens, no duplicates"
    got = [(v.rank, v.decoded_token) for v in result.values()]
    assert got == [(1, "<5>"), (1, "<2>"), (3, "<9>")], (
        "the sampled entry keeps its own rank; top tokens are ranked by position"
    )
    only_top_one = make_logprobs_dicts(ids, lps, sampled_rank=1, num_logprobs=1, decode=None)
    assert list(only_top_one) == [5, 2] and only_top_one[5].decoded_token is None


def test_metadata_leaves_unused_knobs_out():
    greedy, plain = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)
    meta = metadata([greedy, plain])
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None, "no row uses them"
    assert meta.no_penalties and meta.max_num_logprobs is None and meta.min_tokens_blocked == {}
    assert not meta.all_greedy and not meta.all_random, "one greedy row and one random row"
    seeded = SamplingParams(seed=3, logprobs=2, top_k=5, presence_penalty=0.5)
    gens = [torch.Generator(), torch.Generator()]
    meta = metadata([greedy, seeded], generators=gens)
    assert list(meta.generators) == [1], "only random rows keep their generator"
    assert meta.top_k.tolist() == [0, 5] and meta.max_num_logprobs == 2 and not meta.no_penalties


def test_one_pass_sampling_takes_only_the_batches_it_computes_exactly():
    """The Gumbel-max kernel replaces temperature + softmax + the draw (or, for an all-greedy
    batch, the argmax), nothing else: a batch that asks for more (or a seeded one) keeps the
    PyTorch path."""
    from types import SimpleNamespace

    from minivllm.sample.sampler import one_pass_sampling_applies

    on_gpu = SimpleNamespace(is_cuda=True, shape=(2, 4))  # the rule reads only where the logits live and their shape
    plain, greedy = SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)
    assert one_pass_sampling_applies(on_gpu, metadata([plain, greedy])), "temperature only: one pass"
    assert not one_pass_sampling_applies(torch.zeros(2, 4), metadata([plain, greedy])), "CPU logits"
    assert one_pass_sampling_applies(on_gpu, metadata([greedy, greedy])), "all greedy: the kernel's argmax"
    for knob in (dict(top_k=5), dict(top_p=0.9), dict(min_p=0.1), dict(presence_penalty=0.5),
                 dict(repetition_penalty=1.2), dict(min_tokens=3, stop_token_ids=[1])):
        meta = metadata([plain, SamplingParams(temperature=0.7, **knob)])
        assert not one_pass_sampling_applies(on_gpu, meta), f"{knob} needs the PyTorch path"
    seeded = metadata([plain, SamplingParams(temperature=0.7, seed=3)], generators=[None, torch.Generator()])
    assert not one_pass_sampling_applies(on_gpu, seeded), "a seeded row draws from its own generator"
    huge = SimpleNamespace(is_cuda=True, shape=(100_000, 151_936))  # past the 32-bit noise counters
    assert not one_pass_sampling_applies(huge, metadata([plain, greedy])), "too many rows for one launch"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_engine_draws_temperature_only_batches_in_one_pass_and_repeatably(tmp_path, monkeypatch):
    """On a GPU a temperature-only batch goes through the Gumbel-max kernel; torch.manual_seed
    repeats its draws, another seed changes them, and rows with the same prompt differ."""
    import minivllm.kernels as kernels
    from hf_reference import make_tiny_model
    from minivllm import LLM

    calls: list[str] = []
    real_call_kernel = kernels.call_kernel
    monkeypatch.setattr(kernels, "call_kernel", lambda name, *a, **k: calls.append(name) or real_call_kernel(name, *a, **k))
    llm = LLM(str(make_tiny_model("llama", tmp_path)), skip_tokenizer_init=True, device="cuda", dtype="float32",
              max_model_len=256, num_gpu_blocks_override=128)
    # T = 2 flattens the tiny model's peaked next-token distributions: rows can differ.
    params = SamplingParams(temperature=2.0, max_tokens=16, ignore_eos=True, detokenize=False)

    def draws(seed: int) -> list[list[int]]:
        torch.manual_seed(seed)
        outputs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}] * 4, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    first, again, other = draws(0), draws(0), draws(1)
    # A greedy batch takes the same kernel without noise: the tokens of the PyTorch argmax.
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 3]}]
    by_kernel = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    import minivllm.sample.sampler as sampler

    monkeypatch.setattr(sampler, "one_pass_sampling_applies", lambda logits, metadata: False)
    by_torch = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    llm.llm_engine.engine_core.shutdown()
    assert "argmax_sample" in calls, "an all-greedy batch on the GPU must use the kernel's argmax"
    assert by_kernel == by_torch, "the kernel's argmax must pick the PyTorch argmax's tokens"
    assert "gumbel_sample" in calls, "a temperature-only batch on the GPU must use the one-pass kernel"
    assert first == again, "the same torch seed must repeat the draws"
    assert first != other, "another seed must change them"
    assert len({tuple(t) for t in first}) > 1, "rows of one prompt draw independent noise"
