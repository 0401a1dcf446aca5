"""`fw warm-cache`: real downloads from a hub-compatible server on 127.0.0.1 into a
temporary HF cache, verification, C++ kernel builds shared safely by concurrent
processes, the hit/miss report, `fw serve` offline afterwards, precompiled
grammars (--warm-schemas), the plugin hook, and the startup report."""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from fw.kernels import dense, packed_int

import plugin_fixtures as pf
from hub_server import HubServer
from server_fixtures import metric_samples, running_server, server_env

REPO_ID = "tiny/repo"
# sdpa: the flow then builds one C++ library (fw's fused CPU ops, ~10 s) rather than two; the cpu_paged
# kernel's artifact is checked in-process below.
FLAGS = ["--attention-backend", "sdpa"]
# fw's bf16 matmul kernel is one more C++ build where the tiny model runs in bf16 on it (dtype auto)
BF16_KERNEL = int(dense.bf16_kernel_wanted())
PACKED_INT = int(packed_int.wanted())  # fw's kernels for quantized weights: built for every CPU model
SUMMARY = re.compile(r"^hits=(\d+) misses=(\d+)(?: failed=(\d+))?$")


def fw(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fw.cli.main", *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def summary(out: str) -> tuple[int, int, int]:
    """(hits, misses, failed) from the report's last line, which must be the summary."""
    last = out.strip().splitlines()[-1]
    m = SUMMARY.match(last)
    assert m, f"the report does not end with hits=N misses=M:\n{out}"
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def lines(out: str, status: str, artifact: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(status) and f" {artifact} [" in line]


# -- the acceptance path: hub -> warm-cache -> offline serve ------------------------------------


@pytest.fixture(scope="module")
def hub(gqa_dir):
    with HubServer({REPO_ID: gqa_dir}) as server:
        yield server


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, str]:
    """Empty HF and fw caches, shared by this module's processes (warm-cache, then serve); the C++ libraries
    `pip install` built are set aside, so the flow exercises the run-time build that replaces them when they
    are missing (tests/test_cpp_install.py covers the installed ones)."""
    base = tmp_path_factory.mktemp("warm_caches")
    return {"HF_HOME": str(base / "hf"), "HF_HUB_CACHE": str(base / "hf" / "hub"), "FW_CACHE_DIR": str(base / "fw"),
            "FW_CPP_OPS_INSTALLED": "0"}


def env_for(hub: HubServer, caches: dict[str, str], offline: bool = False) -> dict[str, str]:
    return server_env({**caches, "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "1" if offline else "0",
                       "TRANSFORMERS_OFFLINE": "1" if offline else "0"})


@pytest.fixture(scope="module")
def warmed(hub, caches, tmp_path_factory):
    """--check on the empty caches; two `fw warm-cache` processes at once; then, side by side, --check
    and a second warm-cache."""
    cwd = tmp_path_factory.mktemp("warm_cwd")
    env = env_for(hub, caches)
    before = fw(["warm-cache", "--model", REPO_ID, *FLAGS, "--check"], env, cwd)
    requests_during_check = list(hub.requests)
    built_during_check = list(Path(caches["FW_CACHE_DIR"]).glob("*/*/*.so"))
    concurrent = run_together([["warm-cache", "--model", REPO_ID, *FLAGS]] * 2, env, cwd)
    hub.requests.clear()
    after, second = run_together([["warm-cache", "--model", REPO_ID, *FLAGS, "--check"],
                                  ["warm-cache", "--model", REPO_ID, *FLAGS]], env, cwd)
    downloads_after_warm = hub.downloads()
    hub.requests.clear()
    forced = fw(["warm-cache", "--model", REPO_ID, *FLAGS, "--force-download"], env, cwd)
    return types.SimpleNamespace(before=before, requests_during_check=requests_during_check,
                                 built_during_check=built_during_check, concurrent=concurrent, after=after,
                                 second=second, downloads_after_warm=downloads_after_warm, forced=forced,
                                 downloads_when_forced=hub.downloads())


def run_together(commands: list[list[str]], env: dict[str, str], cwd: Path) -> list[types.SimpleNamespace]:
    procs = [subprocess.Popen([sys.executable, "-m", "fw.cli.main", *args], env=env, cwd=cwd, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
             for args in commands]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        results.append(types.SimpleNamespace(returncode=p.returncode, stdout=out, stderr=err))
    return results


def test_check_on_empty_caches_reports_misses_and_touches_nothing(warmed, caches) -> None:
    r = warmed.before
    assert r.returncode == 0, r.stderr
    hits, misses, failed = summary(r.stdout)
    # the model, the fused CPU ops (, the bf16 matmul, the packed-int kernels)
    assert misses == 2 + BF16_KERNEL + PACKED_INT and failed == 0, r.stdout
    assert lines(r.stdout, "miss", "model files") and lines(r.stdout, "miss", "C++ ops cpu_ops"), r.stdout
    assert warmed.requests_during_check == []  # --check never downloads
    assert warmed.built_during_check == []  # ... nor builds


def test_two_warm_caches_at_once_on_empty_caches_both_succeed(warmed, caches) -> None:
    for r in warmed.concurrent:
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-3000:]}"
        assert summary(r.stdout)[2] == 0, r.stdout
        assert lines(r.stdout, "built", "model files") or lines(r.stdout, "hit", "model files"), r.stdout
    outputs = "\n".join(r.stdout for r in warmed.concurrent)
    assert lines(outputs, "built", "C++ ops cpu_ops"), outputs  # one of them built it (the other waited)
    builds = list(Path(caches["FW_CACHE_DIR"]).glob("cpu_ops/*/cpu_ops_*.so"))
    assert len(builds) == 1, builds
    assert not list(builds[0].parent.glob("build-*")), "a private build folder was left behind"
    assert "-       C++ ops cpu_paged [cpu_paged]: nothing to prepare" in outputs  # sdpa was chosen
    snapshot = next(Path(caches["HF_HUB_CACHE"]).glob("models--tiny--repo/snapshots/*"))
    assert (snapshot / "model.safetensors").is_file() and (snapshot / "config.json").is_file()


def test_check_right_after_warm_cache_reports_no_misses(warmed) -> None:
    r = warmed.after
    assert r.returncode == 0, r.stderr
    hits, misses, failed = summary(r.stdout)
    # the model, its config and tokenizer records, the fused CPU ops (, the bf16 matmul, the packed-int kernels)
    assert (misses, failed) == (0, 0) and hits == 4 + BF16_KERNEL + PACKED_INT, r.stdout
    assert lines(r.stdout, "hit", "model records") and "tokenizer" in r.stdout, r.stdout
    assert re.search(r"^for device=cpu .*attention_backend=sdpa$", r.stdout, re.M), r.stdout


def test_a_second_warm_cache_is_all_hits_and_downloads_nothing(warmed) -> None:
    r = warmed.second
    assert r.returncode == 0, r.stderr
    hits, misses, failed = summary(r.stdout)
    assert (misses, failed) == (0, 0), r.stdout
    assert warmed.downloads_after_warm == []  # it asked the hub for the revision, and fetched no file


def test_force_download_fetches_the_files_again(warmed) -> None:
    r = warmed.forced
    assert r.returncode == 0, r.stderr
    assert lines(r.stdout, "built", "model files") and "downloaded" in r.stdout, r.stdout
    # only the model files were redone, and the records made from them (new files, new keys)
    assert summary(r.stdout)[1:] == (3, 0), r.stdout
    assert any(path.startswith("/blobs/") for path in warmed.downloads_when_forced)  # the weights, from the "CDN"


def test_serve_starts_offline_from_the_warmed_cache(warmed, hub, caches, tmp_path) -> None:
    hub.requests.clear()
    args = ["--model", REPO_ID, *FLAGS, "--kv-cache-memory", "32MiB"]
    with running_server(args, tmp_path, env=env_for(hub, caches, offline=True)) as server:
        with server.client() as client:
            r = client.post("/v1/completions", json={"model": REPO_ID, "prompt": "The river", "max_tokens": 5,
                                                     "temperature": 0})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] > 0
        metrics = server.metrics_text()
        log = server.log()
    assert hub.requests == []  # HF_HUB_OFFLINE=1: everything came from the cache
    for phase in ("resolve", "C++ ops", "load weights", "allocate KV cache"):
        assert re.search(rf"startup: {re.escape(phase)} \d+\.\d\d s", log), log
        assert metric_samples(metrics, "fw_startup_phase_seconds", phase=phase), metrics
    assert re.search(r"startup: ready \d+\.\d\d s after process start", log), log
    assert metric_samples(metrics, "fw_startup_ready_seconds")[0] > 0


def test_a_damaged_weights_file_in_the_hf_cache_fails_naming_the_file(warmed, caches, tmp_path) -> None:
    from fw.errors import ModelLoadError
    from fw.model.source import ModelSource
    from fw.commands.warm_cache.model import hub_sizes, verify_source

    copy = tmp_path / "hub"
    shutil.copytree(caches["HF_HUB_CACHE"], copy, symlinks=True)
    weights = next(copy.glob("models--tiny--repo/snapshots/*/model.safetensors"))
    blob = weights.resolve()
    assert copy in blob.parents  # the link is relative: the copy's own blob
    sizes = hub_sizes(weights.parent)  # from huggingface_hub's listing of the commit, kept in the cache
    assert sizes["model.safetensors"] == blob.stat().st_size and "config.json" in sizes
    blob.write_bytes(blob.read_bytes()[:-100])  # an interrupted download
    with pytest.raises(ModelLoadError) as exc:
        verify_source(ModelSource("directory", weights.parent, REPO_ID))
    message = str(exc.value)
    assert message.startswith(f"{weights}: it has ") and "bytes but the hub lists" in message, message
    assert "--force-download" in message


# -- verification --------------------------------------------------------------------------------


@pytest.fixture
def model_copy(gqa_dir, tmp_path) -> Path:
    return Path(shutil.copytree(gqa_dir, tmp_path / "model"))


def test_verification_accepts_a_good_checkpoint_and_names_what_is_wrong(model_copy) -> None:
    from fw.errors import ModelLoadError
    from fw.commands.warm_cache.verify import verify_directory

    good = verify_directory(model_copy)
    assert good.files >= 4 and good.bytes > 100_000
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: .*the hub lists 12"):
        verify_directory(model_copy, {"model.safetensors": 12})
    weights.write_bytes(data + b"\0")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: .*trailing bytes"):
        verify_directory(model_copy)
    weights.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: the safetensors header is not readable JSON"):
        verify_directory(model_copy)
    weights.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(ModelLoadError, match=r"header length field"):
        verify_directory(model_copy)
    weights.write_bytes(data)
    index = {"metadata": {"total_size": 10**9}, "weight_map": {"a": "model.safetensors", "b": "shard-2.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"index\.json: it lists 2 shard files but shard-2\.safetensors is missing"):
        verify_directory(model_copy)
    index["weight_map"]["b"] = "model.safetensors"
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"total_size is 1000000000 bytes but the shards hold"):
        verify_directory(model_copy)


def test_a_damaged_gguf_file_fails_verification(tmp_path) -> None:
    from fw.errors import ModelLoadError
    from fw.commands.warm_cache.verify import verify_gguf

    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ModelLoadError, match=r"model\.gguf: not a readable GGUF file"):
        verify_gguf(bad)


def test_warm_cache_of_a_local_directory_checks_and_reports_it(model_copy, tmp_path, monkeypatch, capsys,
                                                               isolated_plugins) -> None:
    from fw.cli.main import main

    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path / "fw"))
    monkeypatch.setenv("FW_CPP_OPS_INSTALLED", "0")  # cpu_paged's run-time build is what --check reports
    monkeypatch.setenv("FW_CPU_FUSED_OPS", "0")
    monkeypatch.setenv("FW_CPU_WEIGHT_PACKING", "onednn")  # no C++ build for fw's bf16 matmul either
    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")  # nor for the packed-int kernels
    args = ["warm-cache", "--model", str(model_copy), "--attention-backend", "sdpa"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert lines(out, "hit", "model files") and "nothing to download" in out, out
    assert "-       C++ ops cpu_paged [cpu_paged]: nothing to prepare for these flags" in out  # sdpa chosen
    assert summary(out) == (1, 2, 0)  # the files hit; the config and tokenizer records are made
    assert len(lines(out, "built", "model records")) == 2, out
    assert main(["warm-cache", "--model", str(model_copy), "--check"]) == 0  # auto: cpu_paged on a CPU
    out = capsys.readouterr().out
    paged = lines(out, "miss", "C++ ops cpu_paged")
    assert paged and str(tmp_path / "fw" / "cpu_paged") in paged[0] and "attention_backend=cpu_paged" in out, out
    assert not (tmp_path / "fw" / "cpu_paged").exists()  # --check builds nothing
    (model_copy / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"{}")
    assert main([*args, "--check"]) == 0  # a report: the damage shows as a miss
    out = capsys.readouterr().out
    assert lines(out, "miss", "model files") and "fails verification" in out, out
    assert main(args) == 1
    captured = capsys.readouterr()
    assert lines(captured.out, "FAILED", "model files") and "skipped" in captured.out, captured.out


def write_gguf_with_tokenizer(path: Path, tokenizer) -> Path:
    """A GGUF file carrying a byte-level BPE tokenizer (tokens, merges, types) and one tensor: what
    transformers' GGUF tokenizer conversion reads."""
    import gguf
    import numpy as np

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(state["model"]["vocab"].items(), key=lambda kv: kv[1])]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]])
    w.add_token_types([gguf.TokenType.CONTROL if t in tokenizer.all_special_tokens else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_bos_token_id(tokenizer.bos_token_id)
    w.add_eos_token_id(tokenizer.eos_token_id)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_files_tokenizer_conversion_is_warmed(tokenizer, tmp_path, monkeypatch) -> None:
    from fw.config import EngineConfig
    from fw.plugins.manager import PluginManager
    from fw.warm import WarmContext
    from fw.commands.warm_cache.collect import collect
    from fw.commands.warm_cache.runner import run

    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path / "fw"))
    monkeypatch.setenv("FW_CPU_FUSED_OPS", "0")
    monkeypatch.setenv("FW_CPU_WEIGHT_PACKING", "onednn")  # no C++ build for fw's bf16 matmul either
    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")  # nor for the packed-int kernels
    path = write_gguf_with_tokenizer(tmp_path / "tiny.gguf", tokenizer)
    plugins = PluginManager(entry_points=pf.fw_entry_points()).load()

    def report(build: bool) -> tuple[str, object]:
        context = WarmContext(EngineConfig(model=str(path), attention_backend="sdpa"), plugins)
        out: list[str] = []
        result = run(collect(context), context, build=build, emit=out.append)
        return "\n".join(out), result

    out, result = report(build=False)
    assert lines(out, "hit", "model files") and "1 files" in out, out  # the GGUF file read and checked
    assert lines(out, "miss", "GGUF tokenizer") and (result.hits, result.misses) == (1, 1), out
    out, result = report(build=True)
    assert lines(out, "built", "GGUF tokenizer") and result.failed == 0, out
    converted = next((tmp_path / "fw" / "gguf-tokenizers").glob("*/tokenizer.json"))
    assert json.loads(converted.read_text())["model"]["vocab"] == json.loads(
        tokenizer.backend_tokenizer.to_str())["model"]["vocab"]
    out, result = report(build=False)
    assert (result.hits, result.misses, result.failed) == (2, 0, 0), out


# -- plugins and the compile step contribute through one hook ------------------------------------

GOOD = """
from fw.warm import WarmItem

class Autotune:
    name = "autotuned tiles"
    owner = ""
    def check(self, context):
        return [WarmItem("tiles", False, "would tune " + context.config.dtype)]
    def build(self, context):
        return [WarmItem("tiles", False, "tuned")]

@hookimpl
def fw_warm_cache_artifacts(context, add):
    add(Autotune())
"""
BROKEN = """
@hookimpl
def fw_warm_cache_artifacts(context, add):
    raise RuntimeError("cannot list my artifacts")
"""


def test_plugin_and_compile_artifacts_show_in_the_report(root, model_copy, tmp_path, monkeypatch) -> None:
    from fw.config import EngineConfig
    from fw.warm import WarmContext, WarmItem
    from fw.commands.warm_cache.collect import collect
    from fw.commands.warm_cache.runner import run

    for name, body in (("warm_ok", GOOD), ("warm_broken", BROKEN)):
        module = pf.unique(f"fwtest_{name}")
        pf.make_distribution(root, f"fw-{name.replace('_', '-')}", {module: pf.plugin_source(body)}, {name: module})

    class Compiled:
        name, owner = "compiled steps", "fw.compile"

        def check(self, context):
            return [WarmItem("buckets", True, "key abc")]

        build = check

    fake = types.ModuleType("fw.commands.warm_cache.compiled")
    fake.warm_artifacts = lambda context: [Compiled()]
    monkeypatch.setitem(sys.modules, "fw.commands.warm_cache.compiled", fake)
    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path / "fw"))
    monkeypatch.setenv("FW_CPU_FUSED_OPS", "0")
    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")
    context = WarmContext(EngineConfig(model=str(model_copy), dtype="float32", attention_backend="sdpa"),
                          pf.builtin_manager(root))
    out: list[str] = []
    result = run(collect(context), context, build=False, emit=out.append)
    report = "\n".join(out)
    assert "miss    autotuned tiles [warm_ok] tiles: would tune float32" in report
    assert "FAILED  plugin warm_broken: its fw_warm_cache_artifacts hook raised RuntimeError: cannot list" in report
    assert "hit     compiled steps [fw.compile] buckets: key abc" in report
    # model files + compiled steps hit; the tiles and the model's config and tokenizer records miss
    assert (result.hits, result.misses, result.failed) == (2, 3, 1)
    assert report.index("model files") < report.index("autotuned") < report.index("compiled steps")


# -- precompiled grammars (--warm-schemas) ------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


@pytest.fixture
def grammar_context(model_copy, tmp_path, monkeypatch, isolated_plugins):
    from fw.config import EngineConfig
    from fw.model.source import local_source
    from fw.plugins.manager import get_plugin_manager
    from fw.warm import WarmContext

    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path / "fw"))
    monkeypatch.setenv("FW_CPU_FUSED_OPS", "0")
    monkeypatch.setenv("FW_CPU_PACKED_INT", "0")
    schemas = tmp_path / "schemas.json"
    schemas.write_text(json.dumps([SCHEMA, {"regex": "[0-9]{3}-[0-9]{2}"},
                                   {"choice": ["red", "green"], "backend": "outlines"},
                                   {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}]))
    config = EngineConfig(model=str(model_copy), dtype="float32", attention_backend="sdpa")
    context = WarmContext(config, get_plugin_manager(), options={"warm_schemas": schemas})
    context.source = local_source(str(model_copy))  # what the model files artifact sets
    return context


def test_warm_schemas_are_compiled_once_and_reported(grammar_context, tmp_path) -> None:
    from fw.commands.warm_cache.collect import collect
    from fw.commands.warm_cache.runner import run

    out: list[str] = []
    result = run(collect(grammar_context), grammar_context, build=True, emit=out.append)
    report = "\n".join(out)
    assert result.failed == 0, report
    assert len(lines(report, "built", "grammars xgrammar")) == 2, report  # the two equal schemas count once
    assert len(lines(report, "built", "grammars outlines")) == 1, report
    assert len(list((tmp_path / "fw" / "grammars").glob("*/*.bin"))) == 3
    grammar_context.memo.clear()
    out.clear()
    result = run(collect(grammar_context), grammar_context, build=False, emit=out.append)
    assert (result.misses, result.failed) == (0, 0), "\n".join(out)


def _first_masks(compiler, constraint, steps: int = 3) -> list[list[int]]:
    """The allowed-token bitmask rows of the first `steps` positions, walking the first allowed token."""
    from fw.grammar import allocate_token_bitmask, bitmask_to_bool

    matcher = compiler.compile(constraint).matcher()
    rows = []
    for _ in range(steps):
        mask = allocate_token_bitmask(1, compiler.tokenizer.vocab_size)
        matcher.fill_bitmask(mask, 0)
        allowed = bitmask_to_bool(mask, compiler.tokenizer.vocab_size)[0].nonzero().flatten().tolist()
        rows.append(allowed)
        assert matcher.accept_token(allowed[-1])
    return rows


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_servers_load_kept_grammars_instead_of_compiling(backend, grammar_context, monkeypatch) -> None:
    from fw.grammar import Constraint
    from fw.warm import resolve

    registry = grammar_context.plugins.registry("grammar_backend")
    tokenizer = resolve.grammar_tokenizer(grammar_context)
    constraint = Constraint("json_schema", json.dumps(SCHEMA, separators=(",", ":")))
    fresh = registry.get(backend).factory(tokenizer)
    expected = _first_masks(fresh, constraint)
    warm = registry.get(backend).factory(tokenizer)
    assert not warm.persisted(constraint)
    if backend == "xgrammar":  # keeps a grammar only when loading beats compiling: store one outright
        warm._kept.save(constraint, warm.compile(constraint).compiled.serialize_json().encode())
    else:
        warm.persist(constraint)
    assert warm.persisted(constraint)
    server = registry.get(backend).factory(tokenizer)  # a new process's compiler, which must not compile
    if backend == "xgrammar":
        monkeypatch.setattr(server, "_compile", lambda c: pytest.fail("compiled instead of loading"))
    else:
        monkeypatch.setattr(server, "vocabulary", lambda: pytest.fail("compiled instead of loading"))
    assert _first_masks(server, constraint) == expected


def test_xgrammar_persist_keeps_a_grammar_or_records_that_compiling_is_faster(grammar_context) -> None:
    from fw.grammar import Constraint
    from fw.warm import resolve

    compiler = grammar_context.plugins.registry("grammar_backend").get("xgrammar").factory(
        resolve.grammar_tokenizer(grammar_context))
    constraint = Constraint("regex", "[a-z]{2,5}")
    detail = compiler.persist(constraint)
    kept = compiler._kept.store.load(constraint)
    assert ("not kept" in detail) == (kept == b"")
    assert compiler.compile(constraint).matcher() is not None  # an empty entry means: compile it


def test_grammar_store_keys_change_with_the_vocabulary(grammar_context) -> None:
    from fw.grammar import Constraint, GrammarTokenizer
    from fw.warm import resolve
    from fw.warm.grammar import GrammarStore

    tok = resolve.grammar_tokenizer(grammar_context)
    constraint = Constraint("regex", "[0-9]+")
    store = GrammarStore("xgrammar", "v1", tok)
    store.save(constraint, b"compiled")
    wider = GrammarStore("xgrammar", "v1", GrammarTokenizer(tok.hf_tokenizer, tok.vocab_size + 64, tok.eos_token_ids))
    other_version = GrammarStore("xgrammar", "v2", tok)
    assert store.has(constraint) and store.load(constraint) == b"compiled"
    assert not wider.has(constraint) and not other_version.has(constraint)  # a miss, never a wrong hit
    assert not store.has(Constraint("regex", "[0-9]*"))


def test_a_bad_warm_schemas_file_is_a_clear_error(tmp_path, grammar_context) -> None:
    from fw.errors import ConfigError
    from fw.warm.grammar import read_warm_schemas, warm_constraints

    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    with pytest.raises(ConfigError, match=r"--warm-schemas .*bad\.json: not valid JSON"):
        read_warm_schemas(bad)
    bad.write_text(json.dumps({"type": "object"}))
    with pytest.raises(ConfigError, match=r"expected a JSON list"):
        read_warm_schemas(bad)
    bad.write_text(json.dumps([SCHEMA, {"type": "object", "properties": {"a": {"type": "nonsense"}}}]))
    with pytest.raises(ConfigError, match=r"entry 1: "):
        read_warm_schemas(bad)
    bad.write_text(json.dumps([{"grammar": "root ::= \"a\"", "backend": "outlines"}]))
    grammar_context.options["warm_schemas"] = bad
    with pytest.raises(ConfigError, match=r"entry 0: grammar backend 'outlines' cannot take this request"):
        warm_constraints(grammar_context)


# -- the startup report ----------------------------------------------------------------------------


def test_phases_are_recorded_logged_and_kept_per_engine(caplog) -> None:
    from fw.warm import startup

    report = startup.begin()
    with caplog.at_level(logging.INFO, logger="fw.startup"):
        with startup.phase("load weights"):
            pass
        lap = startup.laps()
        lap("resolve")
        lap("resolve")  # a phase run twice adds up
    assert set(report.phases) >= {"load weights", "resolve"}
    assert all(seconds >= 0 for seconds in report.phases.values())
    assert re.search(r"startup: load weights \d+\.\d\d s", caplog.text)
    assert startup.begin() is not report and startup.current() is not report


def test_a_process_a_shell_execs_late_is_dated_from_its_own_start() -> None:
    """The README's first command (`./scripts/bootstrap.sh && .venv/bin/fw serve`) ends with a shell exec'ing
    fw: /proc dates that process from the shell's fork, before the bootstrap, and the startup report once said
    `ready 27.85 s after process start` for a 2.9 s start. A process started directly is dated as before."""
    probe = "import time, fw.warm.startup as s; time.sleep(1); print(s.process_age())"
    late = subprocess.run(["sh", "-c", f'sleep 3; exec "{sys.executable}" -c "{probe}"'], capture_output=True,
                          text=True, check=True)
    assert 1.0 <= float(late.stdout) < 2.5, late.stdout  # its own second, not the shell's 3 s of sleep
    began = time.monotonic()
    direct = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert 1.0 <= float(direct.stdout) <= time.monotonic() - began


def test_the_library_reads_its_engines_startup_report(gqa_dir) -> None:
    from fw import LLM
    from fw.warm import startup

    llm = LLM(str(gqa_dir), dtype="float32", num_kv_blocks=16, attention_backend="sdpa")
    report = llm.engine.startup_report
    assert list(report.phases)[-4:] == [startup.RESOLVE, startup.CPP_OPS, startup.LOAD_WEIGHTS,
                                        startup.ALLOCATE_KV_CACHE]
    assert 0 < sum(report.phases.values()) < 60
    assert "startup: load weights" in str(report)


def test_metrics_expose_the_startup_phases() -> None:
    from prometheus_client import generate_latest

    from fw.server.metrics import ServerMetrics
    from fw.warm.startup import StartupReport

    report = StartupReport()
    report.add("load weights", 1.5)
    metrics = ServerMetrics("m", "sdpa", lambda: {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0,
                                                  "prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0,
                                                  "num_preemptions": 0}, startup=report)
    text = generate_latest(metrics.registry).decode()
    assert metric_samples(text, "fw_startup_phase_seconds", phase="load weights") == [1.5]
    assert not metric_samples(text, "fw_startup_ready_seconds")
    report.add("compile/capture", 2.0)  # recorded after the server was built: still shown
    report.ready_seconds = 4.0
    text = generate_latest(metrics.registry).decode()
    assert metric_samples(text, "fw_startup_phase_seconds", phase="compile/capture") == [2.0]
    assert metric_samples(text, "fw_startup_ready_seconds") == [4.0]
