"""fw.testing's conformance suites over every built-in plugin, the DRY and XTC sampler plugins, and
a deliberately broken attention backend that the kit must fail, naming the failing case.

The built-in suites are enumerated from the plugin registry (distribution "fw"), so a new
built-in gets its suite without editing this file; `test_every_builtin_has_its_suite` checks the
enumeration covers every registered built-in of every kind the kit has a suite for."""

from __future__ import annotations

import re
import textwrap

import pytest

from fw.plugins.manager import get_plugin_manager
from fw.testing import SUITE_KINDS, conformance_suite

pytest_plugins = ("pytester",)

# The suites run many configurations of a compiled backend in one process (flex: 15 here): none may
# fall back to torch's unfused FlexAttention (it did once dynamo's shared recompile limit ran out).
pytestmark = pytest.mark.filterwarnings("error:flex_attention called without torch.compile:UserWarning")

# Suite options for CI time only: outlines-core compiles the generic JSON-object regex in tens of
# seconds on this machine; tests/test_grammar_outlines.py covers json_object.
CI_OPTIONS = {("grammar_backend", "outlines"): dict(constraint_kinds=("json_schema", "regex", "choice"))}


def builtin_names(kind: str) -> list[str]:
    registry = get_plugin_manager().registry(kind)
    return sorted(r.spec.name for r in registry.registrations() if r.distribution == "fw")


ENUMERATED: dict[tuple[str, str], str] = {}
for _kind in SUITE_KINDS:
    for _name in builtin_names(_kind):
        _attr = f"Test_{_kind}_{_name}".replace("-", "_")
        globals()[_attr] = conformance_suite(_kind, _name, **CI_OPTIONS.get((_kind, _name), {}))
        ENUMERATED[_kind, _name] = _attr


def _sampler_plugin(name: str):
    """The DRY / XTC spec, from the installed plugin or the checkout (tests/sampler_plugins.py)."""
    from sampler_plugins import manager_with_sampler_plugins

    return manager_with_sampler_plugins().registry("sampler").get(name)


# The one line an author writes (here with the spec object, so the plugins need not be installed).
TestDrySampler = conformance_suite("sampler", _sampler_plugin("dry"))
TestXtcSampler = conformance_suite("sampler", _sampler_plugin("xtc"), args={"probability": 1.0})


def test_every_builtin_has_its_suite() -> None:
    manager = get_plugin_manager()
    for kind in SUITE_KINDS:
        builtins = {r.spec.name for r in manager.registry(kind).registrations() if r.distribution == "fw"}
        assert builtins, f"no built-in {kind} found: is fw installed (pip install -e .)?"
        for name in builtins:
            assert isinstance(globals().get(ENUMERATED.get((kind, name), "")), type), (kind, name)
    assert {"sdpa", "cpu_paged"} <= set(builtin_names("attention_backend"))
    assert {"llama", "transformers", "mixtral"} <= set(builtin_names("architecture"))


def test_suite_options_are_checked() -> None:
    with pytest.raises(TypeError, match="unknown option.*colour"):
        conformance_suite("attention_backend", "sdpa", colour="red")
    with pytest.raises(ValueError, match="unknown plugin kind 'tool'"):
        conformance_suite("tool", "x")


BROKEN = '''
    """A per-sequence loop backend (docs/plugin-authors.md), once right and once with a bug."""
    import torch

    from fw.layers import AttentionBackend
    from fw.plugins import AttentionBackendSpec
    from fw.testing import conformance_suite


    class LoopBackend(AttentionBackend):
        full_pages_only = False

        def forward(self, q, k, v, kv_cache, meta):
            k_cache, v_cache = kv_cache[0], kv_cache[1]
            k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
            group = self.num_heads // self.num_kv_heads
            starts = meta.query_start_loc.tolist()
            out = torch.empty_like(q)
            for i in range(meta.num_seqs):
                s, n, L = starts[i], meta.query_lens[i], meta.seq_lens[i]
                # the bug: only whole pages are read, so a partly filled last page is dropped
                read = max(L // meta.page_size * meta.page_size, 1) if self.full_pages_only else L
                pages = meta.block_tables[i, : -(-L // meta.page_size)]
                keys = k_cache[pages].flatten(0, 1)[:read].repeat_interleave(group, dim=1)
                values = v_cache[pages].flatten(0, 1)[:read].repeat_interleave(group, dim=1)
                scores = torch.einsum("qhd,khd->hqk", q[s:s + n].float(), keys.float()) * self.scale
                visible = torch.arange(read)[None, :] <= torch.arange(L - n, L)[:, None]
                scores = scores.masked_fill(~visible, float("-inf"))
                out[s:s + n] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.float()).to(q.dtype)
            return out


    class PartialPageBug(LoopBackend):
        full_pages_only = True


    TestLoop = conformance_suite("attention_backend", AttentionBackendSpec("loop", LoopBackend))
    TestBroken = conformance_suite("attention_backend", AttentionBackendSpec("broken", PartialPageBug))
    TestGpuOnly = conformance_suite("attention_backend", AttentionBackendSpec("gpu-only", LoopBackend,
                                                                              devices=("cuda",)), device="cpu")
    TestMissing = conformance_suite("attention_backend", "no-such-backend")
'''


def test_kit_fails_a_broken_backend_naming_the_case(pytester) -> None:
    pytester.makepyfile(test_broken_backend=textwrap.dedent(BROKEN))
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider", "-rfs")
    out = result.stdout.str()
    outcomes = result.parseoutcomes()
    assert result.ret != 0
    # the correct loop passes every case; the GPU-only spec skips every case on CPU with its reason
    assert "TestLoop" not in "".join(line for line in out.splitlines() if line.startswith("FAILED")), out
    assert outcomes.get("skipped", 0) >= 8 and "device 'cpu' not supported (supports cuda)" in out, out
    # the broken one fails, and the summary names the case and the worst difference
    assert "FAILED test_broken_backend.py::TestBroken::test_matches_reference[decode-gqa-page4-head16-fp32]" in out
    assert re.search(r"AssertionError: decode-gqa-page4-head16-fp32: step \d, sequence \d \(.*page size 4\): "
                     r"worst \|backend - reference\| = [0-9.]+ at position", out), out
    assert outcomes["failed"] == len(re.findall(r"^FAILED test_broken_backend.py::TestBroken::", out, re.M)) + 1
    # an uninstalled name fails (not skips), listing the installed backends
    assert "no attention_backend named 'no-such-backend' is installed" in out
    assert "installed attention_backend names: " in out and "sdpa" in out


def test_fixtures(fw_tiny_model, fw_reference_attention, fw_reference_linear) -> None:
    import json

    import torch

    path = fw_tiny_model("llama")
    assert path == fw_tiny_model("LlamaForCausalLM")  # one per architecture per session
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    with pytest.raises(KeyError, match="hf_config"):
        fw_tiny_model("NoSuchForCausalLM")
    q, k, v = torch.randn(2, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    out = fw_reference_attention(q, k, v, scale=8 ** -0.5)
    want = torch.nn.functional.scaled_dot_product_attention(  # the last 2 of 5 positions, causal
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=torch.ones(2, 5, dtype=torch.bool).tril(3)).transpose(0, 1)
    assert torch.allclose(out, want, atol=1e-5)
    x, w, b = torch.randn(3, 4), torch.randn(5, 4), torch.randn(5)
    assert torch.allclose(fw_reference_linear(x, w, b).float(), x @ w.t() + b, atol=1e-5)
