"""Helpers for the plugin, CLI and config tests: a tiny Llama checkpoint made
offline, fake plugin distributions on disk, the example plugin installed into
a temporary directory, and a way to run the `fw` command.

Everything is cached per pytest session (keyed on the session's base temp
directory), so test modules that import these helpers share one copy.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_PLUGIN_SRC = REPO / "plugins" / "fw-example-plugin"

_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello plugins, hello tiny models",
    "a plugin registers samplers, attention backends and architectures",
    "one two three four five six seven eight nine ten",
] * 4

_cache: dict[tuple, Path] = {}
_counter = itertools.count()


def unique(prefix: str) -> str:
    """A module or distribution name no other test uses (imports are cached per process)."""
    return f"{prefix}_{os.getpid()}_{next(_counter)}"


# -- tiny model ---------------------------------------------------------------------------


def _tokenizer(directory: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(directory))
    return fast


def tiny_llama(base: Path, architectures: tuple[str, ...] = ("LlamaForCausalLM",), **config: object) -> Path:
    """A 2-layer Llama checkpoint (float32 safetensors + tokenizer) whose config.json
    names `architectures`; extra keyword arguments go into config.json."""
    key = (str(base), architectures, tuple(sorted(config.items())))
    if key in _cache:
        return _cache[key]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = base / unique("tiny_llama")
    directory.mkdir(parents=True)
    tokenizer = _tokenizer(directory)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
        initializer_range=0.2,  # large enough that greedy choices are not near-ties
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    model.save_pretrained(str(directory))
    # save_pretrained writes the class name into `architectures`; name the one asked for.
    config_file = directory / "config.json"
    data = json.loads(config_file.read_text())
    data.update(config, architectures=list(architectures))
    config_file.write_text(json.dumps(data, indent=2))
    _cache[key] = directory
    return directory


def hf_greedy(model_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The transformers reference: greedy continuation of `prompt_ids`, EOS ignored."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


# -- fake plugin distributions -----------------------------------------------------------------


def make_distribution(root: Path, dist: str, modules: dict[str, str], entry_points: dict[str, str],
                      version: str = "1.0") -> Path:
    """Write `modules` (name -> source) and a `<dist>.dist-info` declaring `entry_points`
    (group fw) under `root`, the layout pip leaves in site-packages."""
    root.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "\n".join(f"{name} = {value}" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text(f"[fw]\n{lines}\n")
    importlib.invalidate_caches()
    return root


def fw_entry_points(*roots: Path, builtin: bool = True) -> list[md.EntryPoint]:
    """Entry points of group fw: fw's own (built-in plugins) plus those of the distributions under `roots`."""
    eps = [ep for ep in md.distribution("fw").entry_points if ep.group == "fw"] if builtin else []
    for dist in md.distributions(path=[str(r) for r in roots]):
        eps.extend(ep for ep in dist.entry_points if ep.group == "fw")
    return eps


def plugin_source(body: str, api_version: str | None = "1.0", imports: str = "") -> str:
    """A plugin module: optional FW_PLUGIN_API_VERSION, then `body` (hook implementations)."""
    header = "from fw.plugins import ArchitectureSpec, AttentionBackendSpec, SamplerSpec, hookimpl\n" + imports
    if api_version is not None:
        header += f"FW_PLUGIN_API_VERSION = {api_version!r}\n"
    return header + textwrap.dedent(body)


def sampler_plugin(stage: str, override: bool = False, api_version: str | None = "1.0") -> str:
    """A plugin registering one no-op sampler stage named `stage`."""
    return plugin_source(f"""
        class Noop:
            def is_active(self, params):
                return False

            def apply(self, logits, batch):
                return logits

        @hookimpl
        def fw_register_samplers(register):
            register(SamplerSpec({stage!r}, Noop, order=99), override={override!r})
        """, api_version)


BROKEN_PLUGIN = "raise RuntimeError('example plugin is broken on purpose')\n"


# -- the example plugin, installed as a user would -----------------------------------------


def install_example_plugin(base: Path) -> Path:
    """`pip install --no-deps --target` of plugins/fw-example-plugin (from a copy, so the
    checkout gets no build/ or egg-info); returns the directory to put on sys.path."""
    key = (str(base), "example-plugin")
    if key in _cache:
        return _cache[key]
    src = base / "example-plugin-src"
    target = base / "example-plugin-site"
    shutil.copytree(EXAMPLE_PLUGIN_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--target", str(target), str(src)],
        check=True, capture_output=True, text=True, timeout=120,
    )
    _cache[key] = target
    return target


# -- running the fw command ----------------------------------------------------------------------


def fw_command() -> list[str]:
    """The installed `fw` console script next to this interpreter, else `python -m fw.cli.main`."""
    script = Path(sys.executable).parent / "fw"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "fw.cli.main"]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without any FW_* variable, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FW_")}
    env.update(extra)
    return env


def run_fw(*args: str, env: dict[str, str] | None = None, pythonpath: list[Path] = (),
           timeout: float = 120) -> subprocess.CompletedProcess:
    env = clean_env(**(env or {}))
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([*fw_command(), *args], env=env, capture_output=True, text=True, timeout=timeout)


def plugins_json(proc: subprocess.CompletedProcess) -> dict[str, dict]:
    """`fw plugins list --json` output as {plugin name: row}."""
    assert proc.returncode == 0, proc.stderr
    return {row["name"]: row for row in json.loads(proc.stdout)["plugins"]}


GREEDY = dict(temperature=0.0, ignore_eos=True)


def small_llm(model: str, **options):
    """An LLM with a small KV cache (the 1 GiB default costs a second to allocate)."""
    from fw import LLM

    return LLM(model, **{"num_kv_blocks": 32, **options})


def greedy(**kwargs):
    """Greedy sampling parameters, EOS ignored, overridable."""
    from fw import SamplingParams

    return SamplingParams(**{**GREEDY, **kwargs})


def builtin_manager(*roots: Path, **kwargs):
    """A plugin manager over fw's own entry points plus fake distributions under `roots`."""
    from fw.plugins.manager import PluginManager

    return PluginManager(entry_points=fw_entry_points(*roots), **kwargs).load()


# -- attention-backend registries for selection tests ------------------------------------------------


class NoBackend:
    """A backend class for specs that are only selected, never run."""


def attention_registry(*specs):
    """A registry holding `specs`, each registered by a distribution named after it."""
    from fw.plugins.registry import Registry

    registry = Registry("attention_backend")
    for spec in specs:
        registry.add(spec, spec.name, f"dist-{spec.name}")
    return registry
