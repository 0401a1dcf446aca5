"""The `flex` backend (FlexAttention over the paged cache through a block mask) against the `sdpa`
reference: one layer's attention over ragged mixed decode + prefill steps (GQA, partial last pages,
page boundaries, cached prefixes, a page shared by two sequences, sliding windows, soft-capping),
then greedy generation with `--attention-backend flex` against `sdpa`: a tiny Llama (also with
chunked prefill) and a tiny Gemma 2 (sliding-window layers and soft-capping).

Compile cost: FlexAttention is compiled (torch.compile, dynamic shapes) once per process per dtype,
head layout, page size and score_mod. The CPU cases share one head layout (4 query / 2 KV heads of
16, the tiny GQA Llama's), page size (16, the engine default) and cache size (256 pages), so the
file compiles three times: plain, soft-capped, and Gemma 2's (its attention scale differs)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from conftest import make_llm
from fw import SamplingParams
from fw.backends.attention import flex
from fw.backends.attention.flex import FlexBackend
from fw.backends.attention.sdpa import SdpaBackend
from fw.layers.attention import AttentionMetadata

pytestmark = pytest.mark.skipif(flex._unavailable() is not None, reason=f"flex cannot run: {flex._unavailable()}")

HEADS, KV_HEADS, HEAD_DIM, PAGE = 4, 2, 16, 16


@dataclass
class Step:
    """One step's inputs: per sequence its new tokens and context length (decodes first), its pages,
    the K/V of its whole history, and the step's queries."""

    query_lens: list[int]
    seq_lens: list[int]
    tables: torch.Tensor
    history: list[tuple[torch.Tensor, torch.Tensor]]  # per sequence: K, V [seq_len, Hkv, D]
    q: torch.Tensor  # [T, H, D]
    num_pages: int


def make_step(query_lens, seq_lens, *, num_pages=256, share_first_page=False, dtype=torch.float32,
              heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page=PAGE, seed=0) -> Step:
    """Shuffled, non-consecutive pages per sequence. `share_first_page`: sequences 0 and 1 hold the
    same first page (prefix caching), with the same keys and values in it."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(-(-n // page) for n in seq_lens) + 1, dtype=torch.long)  # 0-padded
    history = []
    for i, n in enumerate(seq_lens):
        used = -(-n // page)
        for j in range(used):
            tables[i, j] = perm.pop()
        history.append((torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype),
                        torch.randn(n, kv_heads, head_dim, generator=gen).to(dtype)))
    if share_first_page:
        assert min(seq_lens[:2]) - max(query_lens[:2]) >= page, "the shared page must be cached context"
        tables[1, 0] = tables[0, 0]
        for t in range(2):
            history[1][t][:page] = history[0][t][:page]
    q = (torch.randn(sum(query_lens), heads, head_dim, generator=gen) * 2).to(dtype)  # large scores: caps bite
    return Step(list(query_lens), list(seq_lens), tables, history, q, num_pages)


def run(backend_cls, step: Step, window=None, softcap=None, page=PAGE, device="cpu") -> torch.Tensor:
    """The cache holds each sequence's cached prefix; the backend stores the step's new K/V and attends."""
    heads, head_dim = step.q.shape[1:]
    kv_heads = step.history[0][0].shape[1]
    dtype = step.q.dtype
    # garbage everywhere first: slots no sequence of the step owns must not count (pages of others,
    # the tail of a partial last page, the padding entries of the block table)
    shape = backend_cls.kv_cache_shape(step.num_pages, page, kv_heads, head_dim)
    cache = (torch.randn(shape, generator=torch.Generator().manual_seed(99)) * 100).to(dtype)
    head_major = backend_cls.kv_cache_shape(3, 5, 7, 11) == (2, 7, 3, 5, 11)  # sdpa, flex; else [pages, page, Hkv, D]
    new_k, new_v, slots, starts = [], [], [], [0]
    for i, (n_new, n) in enumerate(zip(step.query_lens, step.seq_lens)):
        keys, values = step.history[i]
        for pos in range(n):
            page_id, off = int(step.tables[i, pos // page]), pos % page
            if pos < n - n_new:  # cached context
                for half, x in ((cache[0], keys[pos]), (cache[1], values[pos])):
                    (half[:, page_id, off] if head_major else half[page_id, off])[...] = x
            else:
                slots.append(page_id * page + off)
        new_k.append(keys[n - n_new:])
        new_v.append(values[n - n_new:])
        starts.append(starts[-1] + n_new)
    decodes = next((i for i, n in enumerate(step.query_lens) if n != 1), len(step.query_lens))  # leading ones
    meta = AttentionMetadata(
        num_decodes=decodes, query_lens=step.query_lens, seq_lens=step.seq_lens,
        query_start_loc=torch.tensor(starts, device=device), seq_lens_tensor=torch.tensor(step.seq_lens, device=device),
        block_tables=step.tables.to(device), slot_mapping=torch.tensor(slots, device=device), page_size=page)
    meta.backend_state = backend_cls.prepare(meta)
    layer = backend_cls(heads, kv_heads, head_dim, head_dim ** -0.5, sliding_window=window, logit_softcap=softcap)
    out = layer.forward(step.q.to(device), torch.cat(new_k).to(device), torch.cat(new_v).to(device),
                        cache.to(device), meta)
    return out.float().cpu()


# decodes first, then prefill chunks: a chunk with a cached prefix, a fresh prompt, a one-token chunk
MIXED = dict(query_lens=[1, 1, 1, 1, 7, 20, 1], seq_lens=[1, 16, 17, 33, 23, 20, 40])
CASES = {
    # ragged decodes (a first token, exactly one page, one past a page, two pages + 1) + prefills
    "mixed": MIXED,
    "decode-only": dict(query_lens=[1] * 5, seq_lens=[5, 16, 32, 47, 2]),
    "prefill-only": dict(query_lens=[16, 3, 37], seq_lens=[16, 35, 37]),
    "one-sequence": dict(query_lens=[1], seq_lens=[64]),
    # a page shared by two sequences, as prefix caching leaves it
    "shared-prefix-page": dict(query_lens=[1, 4, 9], seq_lens=[20, 30, 9], share_first_page=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 5, 20], ids=["full", "window5", "window20"])
def test_matches_sdpa(case, window):
    step = make_step(**CASES[case], seed=len(case))
    want = run(SdpaBackend, step, window=window)
    got = run(FlexBackend, step, window=window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if window == 5 and case == "mixed":  # the window changes the result, so the comparison can fail
        assert (want - run(SdpaBackend, step)).abs().max() > 1e-2


@pytest.mark.parametrize("window", [None, 18], ids=["full", "window18"])
def test_softcap_matches_sdpa(window):
    step = make_step(**MIXED, seed=3)
    want = run(SdpaBackend, step, window=window, softcap=2.0)
    torch.testing.assert_close(run(FlexBackend, step, window=window, softcap=2.0), want, atol=1e-5, rtol=1e-5)
    assert (want - run(SdpaBackend, step, window=window)).abs().max() > 1e-2  # the cap bites


def test_query_padding_rows_see_nothing():
    """The step's rows are padded to whole query blocks (at least two); padding rows belong to a
    sequence of their own with no slots, and the real rows' results are unchanged."""
    step = make_step(query_lens=[1, 3], seq_lens=[9, 3], seed=5)
    want = run(SdpaBackend, step)
    state = FlexBackend.prepare(AttentionMetadata(
        num_decodes=1, query_lens=step.query_lens, seq_lens=step.seq_lens,
        query_start_loc=torch.tensor([0, 1, 4]), seq_lens_tensor=torch.tensor(step.seq_lens),
        block_tables=step.tables, slot_mapping=torch.zeros(4, dtype=torch.long), page_size=PAGE))
    assert state.padded == 2 * flex.Q_BLOCK and state.num_tokens == 4
    assert state.row_seq[4:].eq(2).all()  # padding rows read the all -1 row of the slot table
    got = run(FlexBackend, step)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# -- whole engines: greedy generation on a tiny Llama ---------------------------------------------------

PROMPTS = ["a", "Hello world", "The engine schedules every request in pages of keys and values.",
           "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"]
NEW_TOKENS = 20


@pytest.mark.parametrize("layout", [{}, {"prefill_chunk_size": 5, "max_batch_input_tokens": 12}],
                         ids=["default", "chunked"])
def test_greedy_generation_equals_sdpa(layout, gqa_dir):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    runs = {}
    for backend in ("sdpa", "flex"):
        llm = make_llm(gqa_dir, attention_backend=backend, **layout)
        assert llm.engine.loaded.attention.chosen.name == backend
        runs[backend] = llm.generate(PROMPTS, params)
    for ref, out in zip(runs["sdpa"], runs["flex"]):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, out.prompt
        for a, b, token in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, ref.outputs[0].token_ids):
            assert abs(a[token].logprob - b[token].logprob) < 1e-4


def test_gemma2_window_and_softcap_generation_equals_sdpa(tokenizer, tmp_path_factory):
    """Gemma 2: sliding-window layers (window 8, shorter than the prompts) and soft-capped scores."""
    import dense_models

    path = dense_models.build("gemma2", tokenizer, tmp_path_factory.mktemp("flex_gemma2"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = {b: make_llm(path, attention_backend=b).generate(PROMPTS, params) for b in ("sdpa", "flex")}
    for ref, out in zip(runs["sdpa"], runs["flex"]):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids, out.prompt
        for a, b, token in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs, ref.outputs[0].token_ids):
            assert abs(a[token].logprob - b[token].logprob) < 1e-4


# -- CUDA ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("window,softcap", [(None, None), (64, None), (None, 30.0)], ids=["full", "window", "cap"])
def test_matches_sdpa_bf16_on_cuda(window, softcap):
    step = make_step(query_lens=[1] * 6 + [100, 37], seq_lens=[1, 16, 17, 300, 511, 64, 180, 37], num_pages=200,
                     dtype=torch.bfloat16, heads=8, kv_heads=2, head_dim=64, seed=7)
    want = run(SdpaBackend, step, window=window, softcap=softcap, device="cuda")
    got = run(FlexBackend, step, window=window, softcap=softcap, device="cuda")
    # bf16 probabilities round differently in the two kernels; the triton backend's bound for bf16 (seen on
    # an H200: one element of 73,216 off by 0.029 with soft-capping)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
def test_greedy_generation_equals_sdpa_on_cuda(gqa_dir):
    from fw import LLM

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    tokens = {}
    for backend in ("sdpa", "flex"):
        llm = LLM(model=str(gqa_dir), dtype="float32", device="cuda", num_kv_blocks=256, attention_backend=backend)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert tokens["flex"] == tokens["sdpa"]
