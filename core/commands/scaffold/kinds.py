"""What `fw plugins new` writes for each kind: the registry kind it plugs into, the template files
and where they go, the package's dependencies, and a one-line description."""

from __future__ import annotations

from dataclasses import dataclass

COMMON_FILES = {
    "common/pyproject.toml.tmpl": "pyproject.toml",
    "common/README.md.tmpl": "README.md",
    "common/package_init.py.tmpl": "{package}/__init__.py",
}


@dataclass(frozen=True)
class Kind:
    cli_name: str  # --kind value
    registry_kind: str  # fw.plugins.specs.KINDS entry, also the conformance suite's kind
    title: str  # for prose: "an attention backend"
    files: dict[str, str]  # template (under templates/) -> path in the package ({package} substituted)
    dependencies: tuple[str, ...]
    description: str  # pyproject description; `{name}` substituted
    # the oldest plugin API (MAJOR.MINOR) with everything the templates use: what the package declares,
    # so it loads on every fw since (a newer declaration would warn on older cores for nothing)
    min_api_version: str = "1.0"
    template_dir: str = ""  # where README.section.md.tmpl is (default: cli_name)

    def readme_template(self) -> str:
        return f"{self.template_dir or self.cli_name}/README.section.md.tmpl"

    def all_files(self) -> dict[str, str]:
        return {**COMMON_FILES, **self.files}


def _files(kind: str, *extra: tuple[str, str]) -> dict[str, str]:
    return {f"{kind}/plugin.py.tmpl": "{package}/plugin.py",
            f"{kind}/test_plugin.py.tmpl": "tests/test_{package}.py",
            **{f"{kind}/{template}": target for template, target in extra}}


KINDS: dict[str, Kind] = {k.cli_name: k for k in (
    Kind("architecture", "architecture", "architecture",
         _files("architecture", ("config.py.tmpl", "{package}/config.py"), ("model.py.tmpl", "{package}/model.py"),
                ("reference.py.tmpl", "tests/{package}_reference.py")),
         ("fw>=0.1", "torch>=2.5", "transformers>=5.0"),
         "The {name} architecture for fw: a Llama-style decoder built from fw.layers."),
    Kind("attention", "attention_backend", "attention backend", _files("attention"), ("fw>=0.1", "torch>=2.5"),
         "The {name} attention backend for fw: plain PyTorch attention over the paged KV cache."),
    Kind("quantization", "quantization_method", "quantization method", _files("quantization"),
         ("fw>=0.1", "torch>=2.5"),
         "The {name} quantization method for fw: int8 weights with one scale per output channel, "
         "quantized while the checkpoint loads."),
    Kind("sampler", "sampler", "sampler", _files("sampler"), ("fw>=0.1", "torch>=2.5"),
         "The {name} sampler for fw: a per-request top-n-sigma stage with a parameter schema."),
    Kind("grammar", "grammar_backend", "grammar backend", _files("grammar"), ("fw>=0.1", "torch>=2.5"),
         "The {name} grammar backend for fw: choice constraints matched over token bytes."),
)}

# `--kind architecture --hf-class X`: a port of transformers' X (fw.commands.scaffold.port), with transformers'
# own config class (no config.py) and transformers' X as the tests' oracle.
PORT = Kind("architecture", "architecture", "architecture",
            {"architecture_port/plugin.py.tmpl": "{package}/plugin.py",
             "architecture_port/model.py.tmpl": "{package}/model.py",
             "architecture_port/test_plugin.py.tmpl": "tests/test_{package}.py"},
            ("fw>=0.1", "torch>=2.5", "transformers>=5.0"),
            "The {name} architecture for fw: a port of transformers' {hf_class} from fw.layers.",
            min_api_version="1.5", template_dir="architecture_port")  # PostNormDecoderLayer, full-width q/k norm, RMSNorm rounding, DecoderModel(norm=)
