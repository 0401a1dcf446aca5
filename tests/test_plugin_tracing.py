"""`FW_TRACE_PLUGINS=1`: one `fw.plugins.trace` line per plugin import, registration hook and call
into what plugins provide (attention, samplers, grammar, quantization, MoE kernels), with the
plugin's name, shapes/dtypes of the arguments and the duration; nothing (and no wrapping) when off,
and the same tokens either way."""

from __future__ import annotations

import json
import logging
import re

import pytest

import plugin_fixtures as pf
from fw.plugins import tracing
from plugin_fixtures import builtin_manager, greedy, small_llm

pytestmark = pytest.mark.usefixtures("isolated_plugins")

LINE = re.compile(r"^(?P<plugin>\S+) (?P<call>\S+)\((?P<args>.*)\) -> (?P<result>.*) (?P<ms>\d+\.\d{3}) ms$")


class Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def calls(self, call: str, plugin: str | None = None) -> list[logging.LogRecord]:
        return [r for r in self.records if r.call == call and (plugin is None or r.plugin == plugin)]


@pytest.fixture
def trace_log():
    """A handler on the trace logger (attached first, so tracing uses it instead of adding stderr)."""
    logger = logging.getLogger("fw.plugins.trace")
    saved = logger.level, logger.propagate, list(logger.handlers)
    handler = Collect()
    logger.handlers[:] = [handler]
    yield handler
    logger.setLevel(saved[0])
    logger.propagate = saved[1]
    logger.handlers[:] = saved[2]


def test_off_by_default_nothing_wrapped_nothing_logged(trace_log, gqa_dir):
    manager = builtin_manager()
    assert manager.trace is False
    for kind in ("attention_backend", "sampler", "grammar_backend", "architecture"):
        for spec in manager.registry(kind):
            # the plugins' own objects, untouched
            assert getattr(getattr(spec, "backend_cls", None), "_fw_traced_by", None) is None
            assert getattr(getattr(spec, "factory", None), "__wrapped__", None) is None
            assert getattr(getattr(spec, "build", None), "__wrapped__", None) is None
    llm = small_llm(str(gqa_dir), plugins=manager, dtype="float32")
    llm.generate("the model", greedy(max_tokens=2))
    assert trace_log.records == []


def test_registration_and_per_step_calls_are_traced(trace_log, gqa_dir, monkeypatch):
    from fw import SamplingParams

    monkeypatch.setenv("FW_TRACE_PLUGINS", "1")
    traced = builtin_manager()
    assert traced.trace is True
    # Load time: each built-in plugin's import and registration hook, with what it registered.
    imports = {r.plugin for r in trace_log.calls("import")}
    assert {"llama", "sdpa", "cpu_paged", "samplers"} <= imports
    [hook] = trace_log.calls("fw_register_attention_backends", "sdpa")
    assert LINE.match(hook.getMessage()).group("result") == "sdpa" and hook.duration_ms >= 0.0
    assert "temperature" in trace_log.calls("fw_register_samplers", "samplers")[0].getMessage()
    trace_log.records.clear()

    params = SamplingParams(max_tokens=3, temperature=0.8, top_k=5, seed=7)
    prompts = ["the model", "attention layer weight"]
    llm = small_llm(str(gqa_dir), plugins=traced, dtype="float32", attention_backend="sdpa")
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    for record in trace_log.records:  # every line: plugin, call(args) -> result, duration
        m = LINE.match(record.getMessage())
        assert m is not None, record.getMessage()
        assert m.group("plugin") == record.plugin and float(m.group("ms")) == pytest.approx(record.duration_ms,
                                                                                            abs=1e-3)
    assert trace_log.calls("architecture:llama.build", "llama")
    assert trace_log.calls("architecture:llama.load_weights", "llama")
    forwards = trace_log.calls("attention_backend:sdpa.forward", "sdpa")
    prepares = trace_log.calls("attention_backend:sdpa.prepare", "sdpa")
    layers = json.loads((gqa_dir / "config.json").read_text())["num_hidden_layers"]
    assert len(prepares) == 3 and len(forwards) == 3 * layers  # prefill + 2 decodes: once per step, once per layer
    first = forwards[0].getMessage()
    assert "q=float32[" in first and "kv_cache=float32[" in first and "meta=AttentionMetadata(seqs=2" in first
    assert not re.search(r"tensor\(|\d\.\d{4,}e", first)  # shapes, never values
    # the stages these parameters activate, one line per step each; the final choice once per step
    applied = {r.call for r in trace_log.records if r.call.startswith("sampler:") and r.call.endswith(".apply")}
    assert applied == {"sampler:temperature.apply", "sampler:top_k.apply"}
    assert len(trace_log.calls("sampler:top_k.apply", "samplers")) == 3
    chooses = trace_log.calls("sampler:default.choose", "samplers")
    assert len(chooses) == 3 and "batch=SamplingBatch(rows=2)" in chooses[0].getMessage()

    # Tracing changes nothing: the same tokens untraced.
    monkeypatch.delenv("FW_TRACE_PLUGINS")
    plain = small_llm(str(gqa_dir), plugins=builtin_manager(), dtype="float32", attention_backend="sdpa")
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == outs


def test_grammar_compile_and_fill_are_traced(trace_log, gqa_dir):
    from fw import SamplingParams
    from fw.grammar import StructuredOutputsParams

    llm = small_llm(str(gqa_dir), plugins=pf.builtin_manager(trace=True), dtype="float32")
    out = llm.generate("the", SamplingParams(max_tokens=4, temperature=0,
                                             structured_outputs={"choice": ["river", "forest"]}))
    assert out[0].outputs[0].text in ("river", "forest")
    backend = llm.engine.grammar.backend_name(StructuredOutputsParams(choice=["a"]))
    label = f"grammar_backend:{backend}"
    [compiled] = trace_log.calls(f"{label}.compile", backend)
    assert "constraint=Constraint(choice" in compiled.getMessage()
    assert trace_log.calls(f"{label}.factory", backend)
    fills = trace_log.calls(f"{label}.fill_bitmask_batch", backend) + \
        trace_log.calls(f"{label}.matcher.fill_bitmask", backend)
    assert fills and "int32[" in fills[0].getMessage()


def test_quantization_method_calls_are_traced(trace_log, gqa_dir):
    llm = small_llm(str(gqa_dir), plugins=pf.builtin_manager(trace=True), dtype="float32",
                    quantization="bitsandbytes-8bit")
    llm.generate("the model", greedy(max_tokens=2))
    label = "quantization_method:bitsandbytes-8bit"
    assert trace_log.calls(f"{label}.factory", "bitsandbytes")
    loads = trace_log.calls(f"{label}.load_weight", "bitsandbytes")
    applies = trace_log.calls(f"{label}.apply", "bitsandbytes")
    assert loads and applies
    assert re.search(r"layer=\w*Linear\(model\.layers\.0\.\S+, \d+->\d+\)", applies[0].getMessage())
    # lm_head stays on fw's own dense method: not a plugin call, not traced as one
    assert not [r for r in applies if "lm_head" in r.getMessage()]


def test_moe_kernel_and_slotted_objects():
    """A MoE kernel's forward, and objects that take no attributes (a proxy stands in)."""
    import torch

    from fw.plugins import MoeKernelSpec

    class Kernel:
        def forward(self, experts, x, topk_weights, topk_ids):
            return x * 2

    handler, logger = Collect(), logging.getLogger("fw.plugins.trace")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        spec = tracing.traced_spec(MoeKernelSpec("k", Kernel), "my_moe")
        kernel = spec.kernel_cls()
        assert isinstance(kernel, Kernel)
        x = torch.ones(3, 4, dtype=torch.bfloat16)
        assert torch.equal(kernel.forward(None, x, torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.long)), x * 2)
        [record] = handler.calls("moe_kernel:k.forward", "my_moe")
        assert record.getMessage().startswith(
            "my_moe moe_kernel:k.forward(experts=None, x=bfloat16[3,4], topk_weights=float32[3,2], "
            "topk_ids=int64[3,2]) -> bfloat16[3,4] ")

        class Slotted:
            __slots__ = ("n",)

            def __init__(self):
                self.n = 1

            def fill_bitmask(self, bitmask, row):
                return row + self.n

        proxy = tracing.instrument(Slotted(), "g", "grammar_backend:g.matcher", ("fill_bitmask",), proxy_ok=True)
        assert proxy.fill_bitmask(torch.zeros(1, 2, dtype=torch.int32), 4) == 5 and proxy.n == 1
        assert handler.calls("grammar_backend:g.matcher.fill_bitmask", "g")
        slotted = Slotted()
        assert tracing.instrument(slotted, "g", "x", ("fill_bitmask",)) is slotted  # untraced, unbroken
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def test_fw_generate_shows_trace_lines_on_stderr(gqa_dir):
    proc = pf.run_fw("generate", "--model", str(gqa_dir), "--prompt", "the model", "--max-tokens", "2",
                     "--temperature", "0", "--num-kv-blocks", "32", "--dtype", "float32",
                     env={"FW_TRACE_PLUGINS": "1"})
    assert proc.returncode == 0, proc.stderr
    lines = [ln.removeprefix("TRACE fw.plugins.trace: ") for ln in proc.stderr.splitlines()
             if ln.startswith("TRACE fw.plugins.trace: ")]
    assert any(ln.startswith("llama import(") for ln in lines)
    assert any(ln.startswith("llama fw_register_architectures(register) -> llama ") for ln in lines)
    assert any(LINE.match(ln) and ".forward(q=float32[" in ln for ln in lines)
    assert any(ln.startswith("samplers sampler:default.choose(") for ln in lines)
    assert proc.stdout.strip()  # the generated text still goes to stdout, alone

    quiet = pf.run_fw("generate", "--model", str(gqa_dir), "--prompt", "the model", "--max-tokens", "2",
                      "--temperature", "0", "--num-kv-blocks", "32", "--dtype", "float32")
    assert quiet.returncode == 0 and "TRACE" not in quiet.stderr and quiet.stdout == proc.stdout
