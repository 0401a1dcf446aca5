"""The paged KV cache: prefix caching reuses pages and changes no output,
evicted pages are never read back, preemption under a small cache recomputes
to the same tokens, and every page returns to the free list."""

from __future__ import annotations

import pytest

from fw import SamplingParams

PREFIX = ("Once upon a time, in a small village by the river, there lived an old clockmaker. "
          "He built a clock so quiet that the whole city forgot what time it was.")
SUFFIXES = [" The children ran", " Every morning", " def add(a, b):", " 汉字测试"]
PAGE = 4


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def assert_all_pages_free(engine) -> None:
    blocks = engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(rc == 0 for rc in blocks.ref_counts)


@pytest.fixture(scope="module")
def uncached(gqa_dir):
    """Reference outputs (tokens and logprobs) from an engine without prefix caching."""
    from conftest import make_llm

    llm = make_llm(gqa_dir, enable_prefix_caching=False, kv_cache_page_size=PAGE)
    outs = llm.generate([PREFIX + s for s in SUFFIXES], greedy(12, logprobs=0))
    assert llm.engine.stats()["prefix_cache_hit_tokens"] == 0
    return {s: o.outputs[0] for s, o in zip(SUFFIXES, outs)}


@pytest.mark.parametrize("chunk", [None, 5])
def test_shared_prefix_reuses_pages_and_gives_the_same_output(fresh_llm, uncached, chunk):
    llm = fresh_llm(kv_cache_page_size=PAGE, prefill_chunk_size=chunk)
    engine = llm.engine
    first = llm.generate(PREFIX + SUFFIXES[0], greedy(12, logprobs=0))[0]
    assert first.num_cached_tokens == 0
    hits_before = engine.stats()["prefix_cache_hit_tokens"]

    second = llm.generate(PREFIX + SUFFIXES[1], greedy(12, logprobs=0))[0]
    shared = common_prefix_len(first.prompt_token_ids, second.prompt_token_ids)
    assert shared >= 5 * PAGE, "the test prompts must share several full pages"
    expected_hit = (shared // PAGE) * PAGE
    assert second.num_cached_tokens == expected_hit
    assert engine.stats()["prefix_cache_hit_tokens"] - hits_before == expected_hit

    for out, suffix in ((first, SUFFIXES[0]), (second, SUFFIXES[1])):
        ref = uncached[suffix]
        assert out.outputs[0].token_ids == ref.token_ids
        for got, want, token in zip(out.outputs[0].logprobs, ref.logprobs, ref.token_ids):
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-4)
    assert_all_pages_free(engine)


def test_identical_prompt_hits_every_full_page_but_recomputes_the_last_token(fresh_llm, uncached):
    llm = fresh_llm(kv_cache_page_size=PAGE)
    prompt = PREFIX + SUFFIXES[2]
    a = llm.generate(prompt, greedy(12))[0]
    b = llm.generate(prompt, greedy(12))[0]
    n = len(a.prompt_token_ids)
    assert b.num_cached_tokens == ((n - 1) // PAGE) * PAGE  # at least one token left to produce logits
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == uncached[SUFFIXES[2]].token_ids


@pytest.mark.parametrize("tail", [1, 2, PAGE])
def test_prefix_hit_leaving_a_short_tail_to_compute(fresh_llm, tail):
    """After a hit the rest of the prompt may be a single token, which runs through the decode path."""
    prompt = [1] + [(17 * i) % 400 + 50 for i in range(4 * PAGE - 1)] + [300 + i for i in range(tail)]
    cached = fresh_llm(kv_cache_page_size=PAGE)
    cached.generate([prompt[:4 * PAGE] + [9]], greedy(2))  # publishes the first four pages
    got = cached.generate([prompt], greedy(10, logprobs=0))[0]
    assert got.num_cached_tokens == 4 * PAGE
    uncached = fresh_llm(kv_cache_page_size=PAGE, enable_prefix_caching=False)
    want = uncached.generate([prompt], greedy(10, logprobs=0))[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    for g, w, t in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, want.outputs[0].token_ids):
        assert g[t].logprob == pytest.approx(w[t].logprob, abs=1e-4)


def test_n_sequences_share_the_prompt_and_release_everything(fresh_llm):
    llm = fresh_llm(kv_cache_page_size=PAGE)
    engine = llm.engine
    params = SamplingParams(n=3, seed=1, max_tokens=8, ignore_eos=True)
    req = engine.add_request("n3", prompt=PREFIX, params=params)
    usage = []
    while engine.has_unfinished_requests():
        engine.step()
        usage.append(engine.stats()["kv_cache_usage"])
    assert max(usage) > 0
    assert engine.stats()["kv_cache_usage"] == 0.0
    assert [len(s.output_token_ids) for s in req.seqs] == [8, 8, 8]
    assert_all_pages_free(engine)
    # The next request with this prompt finds its pages.
    again = llm.generate(PREFIX, greedy(2))[0]
    assert again.num_cached_tokens >= (len(again.prompt_token_ids) // PAGE - 1) * PAGE


def test_pages_of_generated_tokens_are_reused_too(fresh_llm):
    """A follow-up prompt that repeats an earlier prompt *and its output* hits the output's pages."""
    llm = fresh_llm(kv_cache_page_size=PAGE)
    first = llm.generate(PREFIX, greedy(16))[0]
    follow = first.prompt_token_ids + first.outputs[0].token_ids + [5, 6, 7]
    second = llm.generate([follow], greedy(4))[0]
    # All but the last page of the first sequence was computed and published.
    computed = len(first.prompt_token_ids) + len(first.outputs[0].token_ids) - 1
    assert second.num_cached_tokens == (computed // PAGE) * PAGE
    assert second.num_cached_tokens > len(first.prompt_token_ids)

    ref = fresh_llm(kv_cache_page_size=PAGE, enable_prefix_caching=False).generate([follow], greedy(4))[0]
    assert second.outputs[0].token_ids == ref.outputs[0].token_ids


def test_evicted_pages_are_not_read_back(fresh_llm, uncached):
    """With few pages, cached prefix pages get reused by other requests; a later hit must not
    find their stale hash and read someone else's keys and values."""
    llm = fresh_llm(kv_cache_page_size=PAGE, num_kv_blocks=32)
    engine = llm.engine
    prompts = [PREFIX + s for s in SUFFIXES]
    for _ in range(2):
        for prompt, suffix in zip(prompts, SUFFIXES):
            out = llm.generate(prompt, greedy(12))[0]
            assert out.outputs[0].token_ids == uncached[suffix].token_ids
            # Unrelated traffic that overwrites pages in between.
            llm.generate([[7 + i] * 40 for i in range(2)], greedy(8))
    assert engine.stats()["prefix_cache_hit_tokens"] > 0
    assert_all_pages_free(engine)


def test_running_sequences_share_pages_with_a_later_one(fresh_llm, uncached):
    """Under a tight step budget the second prompt starts after the first has computed its prefix
    pages; it shares them while the first is still running (reference count 2)."""
    llm = fresh_llm(kv_cache_page_size=PAGE, max_batch_input_tokens=24)
    engine = llm.engine
    shared_refs = []
    original = engine.runner.execute

    def execute(seqs, num_new):
        shared_refs.append(max(engine.blocks.ref_counts))
        return original(seqs, num_new)

    engine.runner.execute = execute
    outs = llm.generate([PREFIX + s for s in SUFFIXES[:3]], greedy(12))
    assert outs[0].num_cached_tokens == 0
    assert outs[1].num_cached_tokens > 0 and outs[2].num_cached_tokens > 0
    assert max(shared_refs) >= 2
    for out, suffix in zip(outs, SUFFIXES):
        assert out.outputs[0].token_ids == uncached[suffix].token_ids
    assert_all_pages_free(engine)


def test_prefix_caching_off_never_hits(fresh_llm):
    llm = fresh_llm(kv_cache_page_size=PAGE, enable_prefix_caching=False)
    llm.generate(PREFIX + SUFFIXES[0], greedy(4))
    out = llm.generate(PREFIX + SUFFIXES[0], greedy(4))[0]
    assert out.num_cached_tokens == 0
    assert llm.engine.stats()["prefix_cache_hit_tokens"] == 0


def test_prompt_logprobs_requests_do_not_skip_the_prompt(fresh_llm):
    """Prompt logprobs need every prompt position's logits, so cached pages must not be used."""
    llm = fresh_llm(kv_cache_page_size=PAGE)
    llm.generate(PREFIX, greedy(2))
    out = llm.generate(PREFIX, greedy(2, prompt_logprobs=0))[0]
    assert out.num_cached_tokens == 0
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert all(entry is not None for entry in out.prompt_logprobs[1:])


# -- preemption ----------------------------------------------------------------------------------

PREEMPT_PROMPTS = [
    "Hello world, this is a test",
    "The engine schedules every request",
    "Once upon a time, in a small village",
    "def add(a, b):\n    return a + b",
    "one two three four five six seven",
    "汉字测试：你好，世界！",
]


@pytest.fixture(scope="module")
def alone_outputs(gqa_dir):
    """Each preemption prompt run alone in a roomy cache: greedy tokens and seeded samples."""
    from conftest import make_llm

    llm = make_llm(gqa_dir, kv_cache_page_size=PAGE)
    refs = {}
    for i, prompt in enumerate(PREEMPT_PROMPTS):
        refs[("greedy", i)] = llm.generate(prompt, greedy(24))[0].outputs[0].token_ids
        seeded = SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True)
        refs[("seeded", i)] = llm.generate(prompt, seeded)[0].outputs[0].token_ids
    return refs


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("chunk", [None, 3])
def test_preemption_under_a_small_cache_keeps_outputs_exact(fresh_llm, alone_outputs, prefix_caching, chunk):
    # ~34 tokens per sequence = 9 pages; 20 pages hold about two sequences at once.
    llm = fresh_llm(kv_cache_page_size=PAGE, num_kv_blocks=20, enable_prefix_caching=prefix_caching,
                    prefill_chunk_size=chunk)
    params = []
    for i in range(len(PREEMPT_PROMPTS)):
        if i % 2:
            params.append(SamplingParams(temperature=1.0, seed=100 + i, max_tokens=24, ignore_eos=True))
        else:
            params.append(greedy(24))
    outs = llm.generate(PREEMPT_PROMPTS, params)
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0
    for i, out in enumerate(outs):
        kind = "seeded" if i % 2 else "greedy"
        assert out.outputs[0].token_ids == alone_outputs[(kind, i)], (kind, i)
        assert out.outputs[0].finish_reason == "length"
    assert_all_pages_free(llm.engine)


def test_preempted_prompt_logprobs_are_not_duplicated(fresh_llm, gqa_dir):
    """A sequence preempted in the middle of a chunked prefill recomputes its prompt; its prompt
    logprobs must still hold exactly one entry per prompt token, equal to an unpressured run."""
    from conftest import make_llm

    prompts = [PREFIX + s for s in SUFFIXES]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=1)
    ref = make_llm(gqa_dir, kv_cache_page_size=PAGE).generate(prompts, params)
    llm = fresh_llm(kv_cache_page_size=PAGE, num_kv_blocks=26, prefill_chunk_size=4, max_batch_input_tokens=12)
    outs = llm.generate(prompts, params)
    assert llm.engine.stats()["num_preemptions"] > 0
    for got, want in zip(outs, ref):
        assert len(got.prompt_logprobs) == len(got.prompt_token_ids)
        for g, w, token in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], got.prompt_token_ids[1:]):
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_n_greater_than_one_under_preemption(fresh_llm, gqa_dir):
    from conftest import make_llm

    params = [SamplingParams(n=2, seed=10 + i, max_tokens=20, ignore_eos=True) for i in range(3)]
    prompts = PREEMPT_PROMPTS[:3]
    ref = make_llm(gqa_dir, kv_cache_page_size=PAGE)
    want = [[c.token_ids for c in ref.generate(p, sp)[0].outputs] for p, sp in zip(prompts, params)]
    llm = fresh_llm(kv_cache_page_size=PAGE, num_kv_blocks=20)
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
    assert llm.engine.stats()["num_preemptions"] > 0
    assert got == want
    assert_all_pages_free(llm.engine)


def test_cache_too_small_for_one_sequence_is_an_error_not_a_hang(fresh_llm):
    from fw.errors import PromptTooLongError

    llm = fresh_llm(kv_cache_page_size=PAGE, num_kv_blocks=3)
    with pytest.raises(PromptTooLongError):
        llm.generate([[5] * 10], greedy(4))
    out = llm.generate([[5] * 6], greedy(6))[0]
    assert len(out.outputs[0].token_ids) == 6


def test_page_keys_are_chained_sha256_digests():
    """Prefix-cache keys must resist crafted collisions, which Python's tuple hash does not (a prompt
    colliding with another request's page would read its K/V): each full page's key is SHA-256 over
    its parent page's key and its own token ids, so a change in any earlier page changes every later key."""
    import hashlib
    from array import array
    from types import SimpleNamespace

    from fw.kv_cache.pages import PageManager

    def keys(token_ids: list[int], salt: bytes = b"") -> list[bytes]:
        seq = SimpleNamespace(token_ids=token_ids, block_hashes=[], request=SimpleNamespace(cache_salt=salt))
        PageManager(8, PAGE, enable_prefix_caching=True)._hash_blocks(seq, len(token_ids))
        return seq.block_hashes

    tokens = list(range(100, 111))  # two full pages of 4 and a partial one (never keyed)
    got = keys(tokens)
    first = hashlib.sha256(array("q", tokens[:4]).tobytes()).digest()
    assert got == [first, hashlib.sha256(first + array("q", tokens[4:8]).tobytes()).digest()]
    changed = keys([999] + tokens[1:])
    assert changed[0] != got[0] and changed[1] != got[1]  # same second page, other prefix: another key
    # a request's cache salt (its LoRA adapter, fw.lora) starts the chain: the same tokens, other keys
    salted = keys(tokens, b"lora:0:a")
    assert salted[0] == hashlib.sha256(b"lora:0:a" + array("q", tokens[:4]).tobytes()).digest()
    assert salted[1] != got[1]
