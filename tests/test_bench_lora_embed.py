"""`python -m fw.commands.bench.lora` and `python -m fw.commands.bench.embed` (the figures in docs/lora.md and
docs/embeddings.md) on the tiny models: the random adapter the LoRA bench writes is a real PEFT adapter
that changes the model, every variant runs the tokens asked, and the embedding bench compares fw with
sentence-transformers on the same vectors. Timings are not asserted (benchmarks are commands)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_llm
from fw import LoRARequest, SamplingParams
from fw.commands.bench import embed as embed_bench
from fw.commands.bench import lora as lora_bench
from tiny_encoders import build_bert


def test_the_random_adapter_loads_in_peft_and_in_fw_alike(gqa_dir, tmp_path, tokenizer):
    from peft import PeftModel

    import tiny_models

    llm = make_llm(gqa_dir, enable_lora=True)
    modules = lora_bench.write_random_adapter(llm.engine.loaded.model, tmp_path / "a", rank=4)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    layers = tiny_models.load_hf(gqa_dir).config.num_hidden_layers
    assert modules == 7 * layers and len(config["target_modules"]) == 7
    peft = PeftModel.from_pretrained(tiny_models.load_hf(gqa_dir), str(tmp_path / "a")).eval()
    ids = tokenizer("Once upon a time").input_ids
    with torch.no_grad():
        expected = peft.generate(input_ids=torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = llm.generate({"prompt_token_ids": ids}, greedy, lora_request=LoRARequest("a", str(tmp_path / "a")))
    base = llm.generate({"prompt_token_ids": ids}, greedy)
    assert got[0].outputs[0].token_ids == expected.tolist() != base[0].outputs[0].token_ids


def test_lora_bench_reports_every_variant(gqa_dir, tmp_path, capsys, isolated_plugins):
    out = tmp_path / "lora.json"
    assert lora_bench.main(["--model", str(gqa_dir), "--dtype", "float32", "--rank", "4", "--batch-sizes", "1,3",
                            "--input-len", "6", "--output-len", "3", "--rounds", "1", "--num-kv-blocks", "64",
                            "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["batches"]) == {"1", "3"} and report["rank"] == 4
    for batch, row in report["batches"].items():
        assert row["tokens"] == int(batch) * 3
        assert all(row[v]["tok_s"] > 0 for v in lora_bench.VARIANTS)
        assert row["adapter_overhead_ms_per_token"] == pytest.approx(
            (row["adapter"]["seconds"] - row["base"]["seconds"]) / row["tokens"] * 1000)
    assert "ms/token" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        lora_bench.main(["--batch-sizes", "0,x"])


def test_embed_bench_compares_with_sentence_transformers(tmp_path, capsys, isolated_plugins):
    bert = build_bert(tmp_path / "bert")
    out = tmp_path / "embed.json"
    assert embed_bench.main(["--model", str(bert), "--num-sentences", "40", "--rounds", "1",
                             "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["sentences"] == 40 and report["min_cosine"] >= 0.9999
    assert report["fw_over_sentence_transformers"] == pytest.approx(
        report["sentence_transformers"]["seconds"] / report["fw"]["seconds"])
    assert "fw / sentence-transformers" in capsys.readouterr().out
