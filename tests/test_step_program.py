"""Replayed steps (fw.kernels.step_program, fw.layers.replay): the decoder layers' op calls made from C++ give
the Python forward's numbers to the bit, and every module a program cannot reproduce keeps the Python path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

import dense_models
import gguf_models
from conftest import make_llm
from fw import LoRARequest, SamplingParams
from fw.kernels import cpu_ops, dense, packed_int, step_program
from fw.kernels.step_program import NotReplayable, ProgramBuilder, replays
from fw.layers import PreNormDecoderLayer, replay
from fw.layers.linear import UnquantizedLinearMethod
from fw.lora.layers import LoRALinearMethod

pytestmark = pytest.mark.skipif(step_program.unavailable() is not None or cpu_ops.prepare("cpu") is not None,
                                reason="fw's C++ ops cannot be built here")

PROMPTS = ["Hello world", "The engine schedules every request in pages.", "Once upon a time, in a small village"]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)


def test_a_program_makes_the_calls_it_recorded():
    b = ProgramBuilder(("x", "w"))
    y = b.call("aten::mm", b.input("x"), b.input("w"))  # [rows, 8]
    shifted = b.call("aten::add.Tensor", y, torch.ones(8))  # alpha: the schema's default
    gate_up = b.view(b.narrow(shifted, 0, 8), 2, 4)  # [rows, 2, 4], a view of the first 8 columns
    flat = b.view(gate_up, 8)
    out = b.empty(flat, 4)
    assert b.call("fw_cpu_ops::silu_mul", flat, out) is None  # writes into `out`, returns nothing
    largest = b.call("aten::amax", y, [], False)  # an empty list: typed as the op takes it (all dims)
    heads = b.reshape(b.narrow(y, 2, 4), -1, 2)  # a copy: a column slice cannot be viewed so
    back = b.view(heads, -1, rows_of=b.input("x"))
    x, w = torch.randn(3, 5), torch.randn(5, 8)
    got_y, got_out, got_max, got_back = step_program.run(b, [x, w], [y, out, largest, back])
    want = x @ w + 1
    assert torch.equal(got_back, (x @ w)[:, 2:6]) and got_back.is_contiguous()
    assert torch.equal(got_y, x @ w)
    assert torch.allclose(got_out, torch.nn.functional.silu(want[:, :4]) * want[:, 4:])
    assert torch.equal(got_max, (x @ w).amax())
    # the rows are each run's own
    assert step_program.run(b, [torch.randn(7, 5), w], [out])[0].shape == (7, 4)


def test_a_program_refuses_what_it_cannot_run():
    b = ProgramBuilder(("x",))
    with pytest.raises(NotReplayable, match="no input 'y'"):
        b.input("y")
    with pytest.raises(TypeError, match="takes 2 arguments"):
        b.call("aten::mm", b.input("x"), b.input("x"), b.input("x"))
    with pytest.raises(RuntimeError, match="register 5 does not exist"):
        b.narrow(step_program.Reg(5), 0, 1)
    with pytest.raises(RuntimeError, match="1 inputs expected, got 2"):
        step_program.run(b, [torch.ones(1), torch.ones(1)], [])


def test_a_subclass_with_its_own_forward_is_not_replayed_as_its_parent():
    class OwnForward(PreNormDecoderLayer):
        def forward(self, x, residual, cos_sin, meta):
            return x, residual

    replays(PreNormDecoderLayer.__new__(PreNormDecoderLayer), PreNormDecoderLayer)
    with pytest.raises(NotReplayable, match="OwnForward overrides PreNormDecoderLayer.forward"):
        replays(OwnForward.__new__(OwnForward), PreNormDecoderLayer)


def test_lora_layers_are_not_replayed():
    """A LoRA method adds its adapters' products after the base method's: no step program mirrors that."""
    method = LoRALinearMethod(UnquantizedLinearMethod(), step=None)
    with pytest.raises(NotReplayable, match="LoRALinearMethod"):
        method.emit_step(None, ProgramBuilder(("x",)), None)


def _decoder(llm):
    return llm.engine.loaded.model.model


def _outputs(llm) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, GREEDY)]


def _same_as_python(monkeypatch, make) -> tuple[object, list]:
    """(the replayed engine, its outputs), checked equal to the outputs of an engine whose layers run in Python."""
    monkeypatch.setenv("FW_CPU_STEP_PROGRAM", "0")
    python = make()
    want = _outputs(python)
    assert replay.status(_decoder(python)) == "FW_CPU_STEP_PROGRAM=0"
    monkeypatch.delenv("FW_CPU_STEP_PROGRAM")
    replayed = make()
    got = _outputs(replayed)
    assert replay.status(_decoder(replayed)) == "replayed"
    assert got == want  # tokens and logprobs to the last bit: the same calls, in the same order
    return replayed, got


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_layers_replayed_give_the_python_paths_numbers(monkeypatch, gqa_dir, dtype):
    """fp32 on oneDNN's products; bf16 on fw's bf16 kernel where the CPU has it (with SiLU fused into gate/up)."""
    _same_as_python(monkeypatch, lambda: make_llm(gqa_dir, dtype=dtype))


@pytest.mark.parametrize("family, replayed", [("qwen2", True), ("mistral", True), ("qwen3", True),
                                              ("gemma", False), ("gemma2", False)])
def test_other_families_replay_or_say_why_not(monkeypatch, tmp_path, tokenizer, family, replayed):
    """Qwen2 (biases, a window on some layers), Mistral (a window) and Qwen3 (q/k norms per head) replay;
    Gemma's own layers keep the Python loop."""
    path = dense_models.build(family, tokenizer, tmp_path / family)
    if replayed:
        _same_as_python(monkeypatch, lambda: make_llm(path))
        return
    llm = make_llm(path)
    llm.generate(PROMPTS[:1], GREEDY)
    assert replay.status(_decoder(llm)) != "replayed"  # a refusal, or (Gemma's own model class) never asked


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory, tokenizer) -> Path:
    root = tmp_path_factory.mktemp("gguf_replay")
    tokenizer.save_pretrained(root / "tokenizer")
    return root


@pytest.mark.skipif(not packed_int.wanted() or not packed_int.ready(), reason="no AVX512-VNNI CPU or no C++ toolchain")
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q8_0])
def test_packed_layers_replayed_give_the_python_paths_numbers(monkeypatch, gguf_dir, tokenizer, qtype):
    case = gguf_models.write_tiny_llama_gguf(gguf_dir / f"{qtype.name}.gguf", qtype, tokenizer)
    llm, _ = _same_as_python(monkeypatch, lambda: make_llm(case.path, tokenizer=str(gguf_dir / "tokenizer"),
                                                           dtype="bfloat16", gguf_dequantize_at_load=False))
    assert _decoder(llm).layers[0].self_attn.qkv_proj.packed_int is not None  # the packed kernels ran


def test_new_kv_caches_rebuild_the_program(monkeypatch, gqa_dir):
    llm, first = _same_as_python(monkeypatch, lambda: make_llm(gqa_dir, enable_prefix_caching=False))
    model = _decoder(llm)
    built = model.__dict__[replay._ATTRIBUTE]
    for attention in built.attention:
        attention.kv_cache = attention.kv_cache.clone()
    assert _outputs(llm) == first
    rebuilt = model.__dict__[replay._ATTRIBUTE]
    assert rebuilt is not built and all(c is a.kv_cache for c, a in zip(rebuilt.caches, rebuilt.attention))


def test_a_step_with_a_lora_adapter_after_replayed_steps_applies_it(monkeypatch, gqa_dir, tmp_path):
    """LoRA swaps its methods in only for steps that run an adapter: a program built on a base step must not
    serve them (it would drop the adapter's update)."""
    from test_lora import make_adapter

    make_adapter(gqa_dir, tmp_path / "a", seed=1)
    lora = LoRARequest("a", str(tmp_path / "a"))
    monkeypatch.setenv("FW_CPU_STEP_PROGRAM", "0")
    want = [o.outputs[0].token_ids for o in make_llm(gqa_dir, enable_lora=True).generate(PROMPTS, GREEDY,
                                                                                          lora_request=lora)]
    monkeypatch.delenv("FW_CPU_STEP_PROGRAM")
    llm = make_llm(gqa_dir, enable_lora=True)
    base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert replay.status(_decoder(llm)) == "replayed"  # base steps run the layers' own methods
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=lora)] == want != base
    assert "LoRALinearMethod" in replay.status(_decoder(llm))


def test_a_compiled_models_attention_stand_in_keeps_the_python_path(gqa_dir):
    """torch.compile's stand-in for a backend (fw.compile.traceable) is not an AttentionBackend: the eager steps
    of a compiled model run the Python loop, which reaches the backend through it."""
    from fw.compile.traceable import OpaqueAttention
    from fw.layers.attention import Attention

    llm = make_llm(gqa_dir)
    want = _outputs(llm)
    model = _decoder(llm)
    for i, attention in enumerate(m for m in model.modules() if isinstance(m, Attention)):
        attention.impl = OpaqueAttention(f"layer{i}", attention.impl)
    model.__dict__.pop(replay._ATTRIBUTE)
    assert _outputs(llm) == want
    assert replay.status(model) == "attention backend OpaqueAttention has no step program"


def test_an_emit_step_that_breaks_leaves_the_python_path_with_a_warning(monkeypatch, gqa_dir, caplog):
    from fw.layers import GatedMLP

    monkeypatch.setenv("FW_CPU_STEP_PROGRAM", "0")
    want = _outputs(make_llm(gqa_dir))
    monkeypatch.delenv("FW_CPU_STEP_PROGRAM")

    def broken(self, b, x):
        raise TypeError("a bug in a layer's emit_step")

    monkeypatch.setattr(GatedMLP, "emit_step", broken)
    llm = make_llm(gqa_dir)
    assert _outputs(llm) == want
    assert replay.status(_decoder(llm)) == "recording the step program failed: TypeError: a bug in a layer's emit_step"
    assert "decoder layers run in Python" in caplog.text


def test_a_backend_without_a_step_program_keeps_the_python_path(gqa_dir):
    llm = make_llm(gqa_dir, attention_backend="sdpa")
    llm.generate(PROMPTS[:1], GREEDY)
    assert "has no step program" in replay.status(_decoder(llm))
