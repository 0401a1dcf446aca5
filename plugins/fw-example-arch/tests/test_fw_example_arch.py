"""ParallelLM in fw against its plain PyTorch reference (same fp32 weights): identical greedy
tokens and logprobs within 1e-3, four prompts batched through the paged cache; loaded as an
entry-point plugin and through --custom-architectures without installing; config.json read
through the plugin's config class."""

from __future__ import annotations

import importlib.metadata as md

import pytest

from parallel_lm_reference import PLUGIN_ROOT, build_tokenizer, random_reference, tiny_config, write_checkpoint

PROMPTS = [
    "the quick brown fox",
    "parallel blocks add attention and the mlp to one residual stream",
    "a",
    "one two three four five six seven eight nine ten, a research architecture",
]
NEW_TOKENS = 32
TOL = 1e-3
ENGINE = dict(dtype="float32", kv_cache_page_size=4, num_kv_blocks=128)  # small pages: sequences span many


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def reference(tokenizer):
    return random_reference(tiny_config(tokenizer))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, reference, tokenizer):
    return write_checkpoint(tmp_path_factory.mktemp("parallel_lm"), reference, tokenizer)


@pytest.fixture(scope="module")
def expected(reference, tokenizer):
    return [reference.greedy(tokenizer(p).input_ids, NEW_TOKENS) for p in PROMPTS]


def plugin_manager(with_plugin: bool = True):
    """fw's built-in plugins plus, as an entry point, this package (installed or not)."""
    from fw.plugins.manager import PluginManager

    eps = [ep for ep in md.distribution("fw").entry_points if ep.group == "fw"]
    if with_plugin:
        eps.append(md.EntryPoint(name="example_arch", value="fw_example_arch.plugin", group="fw"))
    return PluginManager(entry_points=eps).load()


def generate_and_check(llm, expected) -> None:
    from fw import SamplingParams

    steps = []
    runner = llm.engine.runner
    execute = runner.execute
    runner.execute = lambda seqs, num_new: steps.append(list(num_new)) or execute(seqs, num_new)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outputs = llm.generate(PROMPTS, params)
    assert max(len(s) for s in steps) == len(PROMPTS), "the prompts never shared a step"
    for out, (tokens, logprobs) in zip(outputs, expected):
        got = out.outputs[0]
        assert got.token_ids == tokens, out.prompt
        assert len(set(tokens)) > 4, "degenerate reference: the check would prove little"
        for pos, (entry, ref) in enumerate(zip(got.logprobs, logprobs)):
            for tid, lp in entry.items():
                assert abs(lp.logprob - ref[tid].item()) < TOL, (pos, tid)


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_matches_the_reference_as_an_entry_point_plugin(backend, checkpoint, expected):
    from fw import LLM
    from fw_example_arch.config import ParallelLMConfig

    llm = LLM(str(checkpoint), plugins=plugin_manager(), attention_backend=backend, **ENGINE)
    loaded = llm.engine.loaded
    assert loaded.architecture.name == "parallel-lm"
    assert isinstance(loaded.hf_config, ParallelLMConfig)  # config.json read through the plugin's class
    assert loaded.hf_config.num_key_value_heads == 2
    generate_and_check(llm, expected)


def test_custom_architectures_without_installing(checkpoint, expected):
    """DIR:MODULE needs nothing installed: fw puts DIR on sys.path and reads the module's ARCHITECTURES."""
    from fw import LLM

    llm = LLM(str(checkpoint), custom_architectures=[f"{PLUGIN_ROOT}:fw_example_arch.plugin"], **ENGINE)
    assert llm.engine.loaded.architecture.name == "parallel-lm"
    generate_and_check(llm, expected)


def test_runs_split_over_two_processes_without_code_of_its_own(checkpoint, expected):
    """fw's tensor parallelism (issue 22) splits the plugin's SelfAttention and GatedMLP by heads and MLP
    columns; the plugin's parallel block sums two row-parallel outputs, each all-reduced."""
    from fw import LLM

    llm = LLM(str(checkpoint), custom_architectures=[f"{PLUGIN_ROOT}:fw_example_arch.plugin"],
              tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.engine.runner.layers[0].num_heads * 2 == llm.engine.loaded.hf_config.num_attention_heads
        generate_and_check(llm, expected)
    finally:
        llm.engine.cluster.close()


def test_without_the_plugin_fw_says_what_is_missing(checkpoint):
    from fw import LLM
    from fw.errors import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError) as err:
        LLM(str(checkpoint), plugins=plugin_manager(with_plugin=False), **ENGINE)
    message = str(err.value)
    assert "ParallelLMForCausalLM" in message and "--custom-architectures" in message
    assert "transformers has no causal-LM class named ParallelLMForCausalLM" in message


def test_config_validates_its_fields(tokenizer):
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        tiny_config(tokenizer, num_key_value_heads=3)
    cfg = tiny_config(tokenizer, num_key_value_heads=None, head_dim=None)
    assert (cfg.num_key_value_heads, cfg.head_dim) == (4, 16)
