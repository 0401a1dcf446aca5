"""LoRA adapters (docs/lora.md) against PEFT on the tiny Llama: random, non-identity adapters
(`init_lora_weights=False`) give fw's greedy tokens at fp32 equal to the PEFT model's and its merged
model's; a batch mixing the base model and two adapters equals each request run alone; prefix-cache
pages are not shared across adapters; loading, unloading and the errors a caller can cause."""

from __future__ import annotations

import json

import pytest
import torch

import tiny_models
from conftest import make_llm
from fw import LoRARequest, SamplingParams
from fw.errors import ConfigError, InvalidRequestError, ModelLoadError
from fw.lora.manager import LoRANotFoundError

PROMPTS = ["Once upon a time", "The engine schedules every request in pages;", "Paris is the capital of",
           "def add(a, b):"]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base_dir, path, seed: int, targets=ALL, r: int = 8, alpha: int = 16, **options):
    """A random PEFT adapter (A and B both random, so it changes the model) saved to `path`; returns the
    PEFT model (over a fresh transformers base) for reference outputs."""
    from peft import LoraConfig, get_peft_model

    base = tiny_models.load_hf(base_dir)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                            init_lora_weights=False, **options))
    with torch.no_grad():  # PEFT's random B is small; make the update count against the base weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(20)
    model.save_pretrained(str(path))
    return model.eval()


def hf_greedy(model, tokenizer, prompt: str, n: int = 12) -> list[int]:
    ids = torch.tensor([tokenizer(prompt).input_ids])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, gqa_dir):
    root = tmp_path_factory.mktemp("lora")
    a = make_adapter(gqa_dir, root / "a", seed=1)
    b = make_adapter(gqa_dir, root / "b", seed=2, targets=["q_proj", "v_proj", "down_proj"], r=4, alpha=8,
                     use_rslora=True)
    return {"a": (root / "a", a), "b": (root / "b", b)}


@pytest.fixture(scope="module")
def lora_llm(gqa_dir):
    return make_llm(gqa_dir, enable_lora=True)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("name", ["a", "b"])
def test_adapter_equals_peft_and_its_merged_model(lora_llm, adapters, tokenizer, hf_model, gqa_dir, name):
    path, peft_model = adapters[name]
    expected = [hf_greedy(peft_model, tokenizer, p) for p in PROMPTS]
    base = [hf_greedy(hf_model(gqa_dir), tokenizer, p) for p in PROMPTS]
    assert expected != base  # the adapter changes the model
    got = tokens(lora_llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest(name, str(path))))
    assert got == expected
    merged = tiny_models.load_hf(gqa_dir)
    merged = make_adapter(gqa_dir, path.parent / f"{name}-again", seed=1 if name == "a" else 2,
                          **({} if name == "a" else dict(targets=["q_proj", "v_proj", "down_proj"], r=4, alpha=8,
                                                         use_rslora=True))).merge_and_unload()
    assert [hf_greedy(merged, tokenizer, p) for p in PROMPTS] == got


def test_the_base_model_is_unchanged_with_lora_on(lora_llm, adapters, tokenizer, hf_model, gqa_dir):
    lora_llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("a", str(adapters["a"][0])))
    assert tokens(lora_llm.generate(PROMPTS, GREEDY)) == [hf_greedy(hf_model(gqa_dir), tokenizer, p) for p in PROMPTS]


def test_a_batch_mixing_base_and_two_adapters_equals_each_alone(lora_llm, adapters):
    a, b = (LoRARequest(n, str(adapters[n][0])) for n in ("a", "b"))
    loras = [None, a, b, a, b, None, a, None]
    prompts = (PROMPTS * 2)[:len(loras)]
    alone = [tokens(lora_llm.generate(p, GREEDY, lora_request=r))[0] for p, r in zip(prompts, loras)]
    assert tokens(lora_llm.generate(prompts, GREEDY, lora_request=loras)) == alone
    assert len({tuple(t) for t in alone[:3]}) == 3 or prompts[0] != prompts[1]


def test_prefix_cache_pages_are_not_shared_across_adapters(gqa_dir, adapters):
    llm = make_llm(gqa_dir, enable_lora=True, kv_cache_page_size=4)
    prompt = PROMPTS[1] * 3
    a, b = (LoRARequest(n, str(adapters[n][0])) for n in ("a", "b"))
    first = llm.generate(prompt, GREEDY, lora_request=a)[0]
    assert first.num_cached_tokens == 0
    assert llm.generate(prompt, GREEDY, lora_request=a)[0].num_cached_tokens > 0  # same adapter: reused
    other = llm.generate(prompt, GREEDY, lora_request=b)[0]
    assert other.num_cached_tokens == 0 and other.outputs[0].token_ids != first.outputs[0].token_ids
    assert llm.generate(prompt, GREEDY)[0].num_cached_tokens == 0  # nor with the base model


def test_load_use_unload_reload(gqa_dir, adapters):
    llm = make_llm(gqa_dir, lora_modules=[f"a={adapters['a'][0]}"], kv_cache_page_size=4)
    assert llm.config.enable_lora  # --lora-modules turns it on
    a_out = tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("a")))
    llm.engine.remove_lora("a")
    with pytest.raises(LoRANotFoundError, match="no LoRA adapter named 'a'"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("a"))
    llm.engine.add_lora("a", str(adapters["b"][0]))  # the name again, other weights: no stale cached pages
    b_out = tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("a")))
    assert b_out == tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("b", str(adapters["b"][0]))))
    assert b_out != a_out
    llm.engine.add_request("busy", prompt=PROMPTS[0], params=GREEDY, lora_request=LoRARequest("a"))
    with pytest.raises(InvalidRequestError, match="in use by 1 request"):
        llm.engine.remove_lora("a")
    llm.engine.abort_request("busy")
    llm.engine.remove_lora("a")


def test_errors(gqa_dir, adapters, tmp_path, llm):
    with pytest.raises(InvalidRequestError, match="start it with --enable-lora"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("a", str(adapters["a"][0])))
    small = make_llm(gqa_dir, enable_lora=True, max_loras=1, max_lora_rank=4)
    with pytest.raises(ModelLoadError, match="rank 8, above --max-lora-rank 4"):
        small.engine.add_lora("a", str(adapters["a"][0]))
    small.engine.add_lora("b", str(adapters["b"][0]))
    with pytest.raises(InvalidRequestError, match="already loaded"):
        small.engine.add_lora("b", str(adapters["b"][0]))
    with pytest.raises(ConfigError, match=r"--max-cpu-loras \(1\) must be at least --max-loras \(2\)"):
        make_llm(gqa_dir, enable_lora=True, max_loras=2, max_cpu_loras=1)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in adapters["b"][0].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    with pytest.raises(ModelLoadError, match="modules_to_save"):
        make_llm(gqa_dir, lora_modules=[f"bad={bad}"])
    with pytest.raises(ConfigError, match="NAME=PATH"):
        make_llm(gqa_dir, lora_modules=["nopath"])
    with pytest.raises(ConfigError, match="torch-compile"):
        make_llm(gqa_dir, enable_lora=True, enable_torch_compile=True)


def test_max_cpu_loras_evicts_the_least_recently_used_and_reads_it_back(gqa_dir, adapters, lora_llm):
    """vLLM's --max-cpu-loras: more adapters registered than held; the one unused longest is evicted and read
    again from its path when named, with the same output (and its prefix-cache pages still its own)."""
    expected = {n: tokens(lora_llm.generate(PROMPTS[:2], GREEDY, lora_request=LoRARequest(n, str(adapters[n][0]))))
                for n in ("a", "b")}
    llm = make_llm(gqa_dir, enable_lora=True, max_loras=1, max_cpu_loras=2, kv_cache_page_size=4,
                   lora_modules=[f"a={adapters['a'][0]}", f"b={adapters['b'][0]}", f"a2={adapters['a'][0]}"])
    lora = llm.engine.lora
    assert list(lora.registered) == ["a", "b", "a2"] and list(lora.slots) == ["b", "a2"] and lora.num_evictions == 1
    first = llm.generate(PROMPTS[:2], GREEDY, lora_request=LoRARequest("a"))  # read back; b goes
    assert tokens(first) == expected["a"] and list(lora.slots) == ["a2", "a"] and lora.num_evictions == 2
    assert tokens(llm.generate(PROMPTS[:2], GREEDY, lora_request=LoRARequest("b"))) == expected["b"]
    again = llm.generate(PROMPTS[:2], GREEDY, lora_request=LoRARequest("a"))  # evicted by b, read back again
    assert tokens(again) == expected["a"] and all(o.num_cached_tokens > 0 for o in again)  # same registration
    assert tokens(llm.generate(PROMPTS[:2], GREEDY, lora_request=LoRARequest("a2"))) == expected["a"]


def test_adapters_that_requests_run_with_are_never_evicted(gqa_dir, adapters):
    from fw.lora.manager import LoRACapacityError

    llm = make_llm(gqa_dir, enable_lora=True, max_loras=1, max_cpu_loras=1,
                   lora_modules=[f"a={adapters['a'][0]}", f"b={adapters['b'][0]}"])
    llm.engine.add_request("busy", prompt=PROMPTS[0], params=GREEDY, lora_request=LoRARequest("b"))
    with pytest.raises(LoRACapacityError, match=r"--max-cpu-loras 1: b\) all have requests running") as err:
        llm.engine.add_request("other", prompt=PROMPTS[0], params=GREEDY, lora_request=LoRARequest("a"))
    assert err.value.status_code == 429
    llm.engine.abort_request("busy")
    assert llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("a"))[0].outputs[0].token_ids


def test_max_loras_bounds_the_adapters_of_one_batch(gqa_dir, adapters, lora_llm):
    """vLLM's --max-loras: with 1, a step never runs two adapters; a request whose adapter has no room waits
    while those behind it (the base model's, the running adapter's) go; every output equals its run alone."""
    llm = make_llm(gqa_dir, enable_lora=True, max_loras=1, max_cpu_loras=2,
                   lora_modules=[f"a={adapters['a'][0]}", f"b={adapters['b'][0]}"])
    loras = [LoRARequest("a"), LoRARequest("b"), None, LoRARequest("a"), LoRARequest("b"), None]
    alone = [tokens(lora_llm.generate(PROMPTS[i % 4], GREEDY, lora_request=None if r is None else
                                      LoRARequest(r.name, str(adapters[r.name][0]))))[0] for i, r in enumerate(loras)]
    engine = llm.engine
    for i, r in enumerate(loras):
        engine.add_request(f"r{i}", prompt=PROMPTS[i % 4], params=GREEDY, lora_request=r)
    running, got = [], {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        running.append({s.request.lora_name for s in engine.scheduler.running})
    assert all(len(names - {None}) <= 1 for names in running), running
    assert {"a", None} <= running[0] and "b" not in running[0]  # b waited; the base request behind it did not
    assert [got[f"r{i}"] for i in range(len(loras))] == alone


@pytest.mark.parametrize("dtype, quantization", [("bfloat16", None), ("float32", "fp8"), ("bfloat16", "fp8")])
def test_over_bf16_and_quantized_base_weights(gqa_dir, adapters, tokenizer, hf_model, dtype, quantization):
    """The update runs over whatever the base layer is: bf16 (whose MLP gate/up weight is packed for a fused SiLU
    kernel that would skip it: with LoRA the layer takes the unfused path) or fp8-quantized weights. Prompt
    logprobs land near PEFT's fp32 ones and far from the base model's."""
    from fw.kernels import dense

    path, peft_model = adapters["a"]
    llm = make_llm(gqa_dir, enable_lora=True, dtype=dtype, quantization=quantization)
    gate_up = llm.engine.loaded.model.model.layers[0].mlp.gate_up_proj
    prompt = PROMPTS[1]
    out = llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       lora_request=LoRARequest("a", str(path)))
    ids = tokenizer(prompt).input_ids
    got = torch.tensor([entry[t].logprob for entry, t in zip(out[0].prompt_logprobs[1:], ids[1:])])

    def reference(model) -> torch.Tensor:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]

    to_peft = (got - reference(peft_model)).abs().mean()
    to_base = (got - reference(hf_model(gqa_dir))).abs().mean()
    assert to_peft < 0.2 and to_base > 10 * to_peft, (to_peft, to_base)
    if dtype == "bfloat16" and quantization is None and dense.bf16_kernel_ready():  # packed for the fused SiLU
        assert dense.is_gate_up_bf16(gate_up.weight) and not gate_up.silu_gate_up


# -- over HTTP ------------------------------------------------------------------------------------------


def test_http_load_use_unload_reuse(gqa_dir, adapters, lora_llm):
    from fastapi.testclient import TestClient

    from fw.config import EngineConfig
    from fw.engine.factory import create_engine
    from fw.server.app import build_app
    from fw.server.async_engine import AsyncEngine
    from fw.server.config import ServerConfig
    from fw.server.metrics import ServerMetrics
    from fw.server.state import ServerState

    engine = create_engine(EngineConfig(model=str(gqa_dir), dtype="float32", num_kv_blocks=128,
                                        lora_modules=[f"a={adapters['a'][0]}"]))
    async_engine = AsyncEngine(engine)
    state = ServerState(async_engine, ServerConfig(api_key="k"), ["tiny"],
                        ServerMetrics("tiny", "x", lambda: async_engine.stats))
    auth = {"Authorization": "Bearer k"}
    expected = {n: tokens(lora_llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest(n, str(adapters[n][0]))))[0]
                for n in ("a", "b")}
    base = tokens(lora_llm.generate(PROMPTS[0], GREEDY))[0]

    def complete(client, model):
        r = client.post("/v1/completions", headers=auth, json={
            "model": model, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        return r, (r.json()["choices"][0]["text"] if r.status_code == 200 else None)

    text = lambda ids: lora_llm.tokenizer.decode(ids)  # noqa: E731
    with TestClient(build_app(state)) as client:
        models = {m["id"]: m for m in client.get("/v1/models", headers=auth).json()["data"]}
        assert set(models) == {"tiny", "a"} and models["a"]["parent"] == "tiny"
        assert complete(client, "a")[1] == text(expected["a"])
        assert complete(client, "tiny")[1] == text(base)
        r, _ = complete(client, "b")
        error = r.json()["error"]  # OpenAI's error body
        assert r.status_code == 404 and error["type"] == "not_found_error" and error["code"] == 404
        assert "The model `b` does not exist" in error["message"] and "LoRA adapters a" in error["message"]
        load = {"lora_name": "b", "lora_path": str(adapters["b"][0])}
        assert client.post("/v1/load_lora_adapter", json=load).status_code == 401  # behind the API key
        assert client.post("/v1/load_lora_adapter", headers=auth, json=load).status_code == 200
        assert client.post("/v1/load_lora_adapter", headers=auth, json=load).status_code == 400  # loaded already
        assert complete(client, "b")[1] == text(expected["b"])
        chat = client.post("/v1/chat/completions", headers=auth, json={
            "model": "b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
        assert chat.status_code == 200 and chat.json()["model"] == "b"
        assert client.post("/v1/unload_lora_adapter", headers=auth, json={"lora_name": "b"}).status_code == 200
        assert complete(client, "b")[0].status_code == 404
        r = client.post("/v1/unload_lora_adapter", headers=auth, json={"lora_name": "b"})
        assert r.status_code == 404 and "no LoRA adapter named 'b'" in r.json()["error"]["message"]
        assert client.post("/v1/load_lora_adapter", headers=auth, json=load).status_code == 200
        assert complete(client, "b")[1] == text(expected["b"])
