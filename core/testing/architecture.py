"""The architecture suite: load a tiny random checkpoint with fw through this spec, generate a few
greedy tokens for two prompts in one batch, and compare with transformers on the same weights
(identical tokens, logprobs within 1e-3, fp32).

One case per Hugging Face architecture the spec claims that `fw.testing.models` can build, or
the `hf_config` option's config (a transformers config; its `architectures` names the class).
A fallback spec (`fallback=True`, like the built-in `transformers`) runs with
`--model-impl transformers` on a Llama checkpoint unless `hf_config` says otherwise. The spec is
handed to fw as a custom architecture, so it is the one tested even where another installed
plugin claims the same Hugging Face name."""

from __future__ import annotations

import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import torch

from fw import LLM, SamplingParams
from fw.plugins.manager import PluginManager
from fw.testing import models
from fw.testing.suite import Case, SuiteTest, device_for

OPTIONS = frozenset({"hf_config", "max_new_tokens"})
PROMPTS = ["The quick brown fox jumps over", "def add(a, b):"]
LOGPROB_TOLERANCE = 1e-3
_checkpoints: dict[str, Path] = {}


def tests(spec: Any, options: dict) -> list[SuiteTest]:
    device = device_for(spec, {**options, "device": options.get("device") or "cpu"})
    hf_config = options.get("hf_config")
    cases = []
    if hf_config is not None:
        models.check_vocab(hf_config, "conformance_suite('architecture', hf_config=...)")  # at collection, not mid-run
        arch = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
        cases.append(Case(arch, {"arch": arch, "hf_config": hf_config}))
    else:
        names = spec.hf_architectures or (("LlamaForCausalLM",) if spec.fallback else ())
        for arch in names:
            skip = None if arch in models.ARCHITECTURES else (
                f"fw.testing has no tiny-model factory for {arch}; pass hf_config=<a transformers config>")
            cases.append(Case(arch, {"arch": arch, "hf_config": None}, skip))
    if not cases:
        cases.append(Case("no-hf-architecture", {}, "the spec claims no Hugging Face architecture; pass hf_config="))
    steps = int(options.get("max_new_tokens") or 6)
    return [SuiteTest("test_generation_matches_transformers", lambda case: run_case(spec, case, device, steps),
                      cases, "Weights load and greedy tokens and logprobs match transformers.")]


def checkpoint(arch: str, hf_config: Any = None) -> Path:
    """A cached tiny checkpoint per architecture (per process), or a fresh one for a given config."""
    if hf_config is not None:
        return models.tiny_checkpoint(None, tempfile.mkdtemp(prefix="fw-testing-"), hf_config=hf_config)
    if arch not in _checkpoints:
        _checkpoints[arch] = models.tiny_checkpoint(arch, tempfile.mkdtemp(prefix=f"fw-testing-{arch}-"))
    return _checkpoints[arch]


def plugins_with(spec: Any):
    """A private plugin manager with the installed plugins plus `spec`, registered as a custom
    architecture (tried before every other spec, overriding one of the same name)."""
    manager = PluginManager().load()
    module_name = f"fw_testing_arch_{abs(hash(spec.name))}"
    module = types.ModuleType(module_name)
    module.ARCHITECTURES = [spec]
    sys.modules[module_name] = module
    manager.add_custom_architectures([module_name])
    return manager


def run_case(spec: Any, case: Case, device: str, steps: int) -> None:
    path = checkpoint(case.data["arch"], case.data["hf_config"])
    llm = LLM(str(path), plugins=plugins_with(spec), dtype="float32", device=device, num_kv_blocks=64,
              kv_cache_page_size=4, model_impl="transformers" if spec.fallback else "auto")
    chosen = llm.engine.loaded.architecture
    if chosen.name != spec.name:
        raise AssertionError(f"{case.id}: fw ran the model with architecture {chosen.name!r}, not {spec.name!r}")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=1))
    hf = models.load_reference(path)
    tok = models.tokenizer()
    for out, prompt in zip(outs, PROMPTS):
        want, ref_logprobs = models.greedy_reference(hf, tok(prompt).input_ids, steps)
        got = out.outputs[0]
        if got.token_ids != want:
            first = next(i for i, (a, b) in enumerate(zip(got.token_ids, want)) if a != b)
            raise AssertionError(f"{case.id}: prompt {prompt!r}: greedy tokens differ from transformers at step "
                                 f"{first}: fw {got.token_ids}, transformers {want}")
        worst, where = 0.0, 0
        for step, (entry, token, ref) in enumerate(zip(got.logprobs, want, ref_logprobs)):
            if abs(entry[token].logprob - ref[token].item()) > worst:
                worst, where = abs(entry[token].logprob - ref[token].item()), step
        if worst > LOGPROB_TOLERANCE:
            raise AssertionError(f"{case.id}: prompt {prompt!r}: worst |logprob fw - transformers| = {worst:.4g} at "
                                 f"step {where} (tolerance {LOGPROB_TOLERANCE:g})")
