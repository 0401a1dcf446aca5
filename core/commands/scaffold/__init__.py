"""`fw plugins new`: write a working, installable plugin package of one kind.

The package is real code, not a skeleton: it installs with pip, registers through the `fw` entry
point, and its tests (its own and fw's conformance suite, `fw.testing`) pass as generated. The
templates are files in `fw/commands/scaffold/templates/`, rendered with string.Template."""

from __future__ import annotations

import importlib.metadata as md
import textwrap
from pathlib import Path
from typing import Iterable

from fw.errors import ConfigError
from fw.commands.scaffold.kinds import KINDS, PORT, Kind
from fw.commands.scaffold.names import PluginNames, check_name
from fw.commands.scaffold.render import render, write_files
from fw.version import PLUGIN_API_VERSION, __version__

__all__ = ["KINDS", "PluginNames", "check_name", "new_plugin", "template_values"]


def template_values(kind: Kind, names: PluginNames, port=None) -> dict[str, str]:
    """Every placeholder the templates use (`port`: a fw.commands.scaffold.port.Port for --hf-class)."""
    package_files = sorted(Path(target.format(package=names.package)).name
                           for target in kind.all_files().values() if target.startswith("{package}/"))
    test_files = sorted(Path(target.format(package=names.package)).name
                        for target in kind.all_files().values() if target.startswith("tests/"))
    values = {
        "name": names.name,
        "distribution": names.distribution,
        "package": names.package,
        "entry_point": names.entry_point,
        "camel": names.camel,
        "kind": kind.cli_name,
        "registry_kind": kind.registry_kind,
        "kind_title": kind.title,
        "description": kind.description.format(name=names.name, hf_class=port.hf_class if port else ""),
        "dependencies": ", ".join(f'"{d}"' for d in kind.dependencies),
        "fw_version": __version__,
        "api_version": PLUGIN_API_VERSION,
        "min_api_version": kind.min_api_version,
        "package_layout": _tree(package_files, "│   "),
        "test_layout": _tree(test_files, "    "),
        "hf_architecture": f"{names.camel}ForCausalLM",
        "model_type": f"fw_{names.entry_point}",
    }
    if port is not None:
        values.update(port_values(port))
    values["kind_readme"] = render(kind.readme_template(), values).rstrip("\n")
    return values


def _tree(files: list[str], indent: str) -> str:
    return "".join(f"{indent}{'└──' if i == len(files) - 1 else '├──'} {f}\n" for i, f in enumerate(files))


def port_values(port) -> dict[str, str]:
    """The architecture_port templates' placeholders: the decoder layer's body from what `port` found."""
    import transformers  # here: transformers costs 0.6 s; only an architecture's scaffold needs it

    norm = 'RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.dtype, rounding=ROUNDING)'
    indent = "\n" + " " * 39  # under SelfAttention's first argument
    qk = "" if port.qk_norm is None else (f",{indent}qk_norm_eps=cfg.norm_eps, "
                                          f"qk_norm_width=\"{port.qk_norm}\", qk_norm_rounding=ROUNDING")
    attention = (f"self.self_attn = SelfAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, "
                 f"cfg.head_dim,{indent}ctx, f\"{{prefix}}.self_attn\",{indent}qkv_bias={port.qkv_bias}, "
                 f"o_bias={port.o_bias}{qk})")
    mlp = (f"self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx, f\"{{prefix}}.mlp\", "
           f"hidden_act=cfg.hidden_act,\n{' ' * 28}bias={port.mlp_bias})")
    if port.layer == "post_norm":
        lines = [attention, f"self.post_attention_layernorm = {norm}", mlp, f"self.post_feedforward_layernorm = {norm}"]
        doc = "x + norm(attention(x)), then x + norm(mlp(x)): PostNormDecoderLayer.forward."
    else:
        lines = [f"self.input_layernorm = {norm}", attention, f"self.post_attention_layernorm = {norm}", mlp]
        doc = "attention then MLP, each after its RMSNorm: PreNormDecoderLayer.forward carries the residual."
    return {"hf_class": port.hf_class, "config_class": port.config_class, "rounding": port.rounding,
            "layer_base": "PostNormDecoderLayer" if port.layer == "post_norm" else "PreNormDecoderLayer",
            "layer_doc": doc, "layer_body": "\n".join(" " * 8 + line for line in lines),
            "summary": port.summary(), "transformers_version": transformers.__version__,
            "summary_wrapped": textwrap.fill(port.summary() + ".", width=100)}


def new_plugin(kind: str, name: str, output_dir: str | Path = ".", *, taken: Iterable[str] = (),
               hf_class: str | None = None, served: dict[str, str] | None = None) -> Path:
    """Write the package for plugin `name` of `kind` under `output_dir`; return its directory.

    `taken`: names already registered for that kind (the caller's loaded plugins): a package that
    registered one of them again would fail to load with DuplicatePluginNameError, so refuse now.
    `hf_class` (architectures only): port transformers' class of that name instead of writing a new
    architecture; `served`: Hugging Face architecture -> the installed fw architecture serving it."""
    if kind not in KINDS:
        raise ConfigError(f"unknown plugin kind {kind!r}; choose one of: {', '.join(KINDS)}")
    spec = KINDS[kind]
    names = PluginNames.from_name(name)
    port = None
    if hf_class is not None and kind != "architecture":
        raise ConfigError(f"--hf-class ports a transformers architecture: use it with --kind architecture, not {kind}")
    if kind == "architecture":
        claimed = hf_class or f"{names.camel}ForCausalLM"
        if claimed in (served or {}):
            raise ConfigError(f"{claimed} is already served by the installed architecture {served[claimed]!r} "
                              "(`fw plugins list --kind architecture`); choose another NAME, or --hf-class for a "
                              "class fw does not serve yet")
        if hf_class is None and _transformers_has(claimed):
            raise ConfigError(f"NAME {name!r} would register {claimed}, which transformers already defines; a new "
                              f"architecture would claim it with a placeholder Llama body. Port it instead: "
                              f"`fw plugins new --kind architecture --hf-class {claimed} {name}`, or choose another "
                              "NAME for an architecture of your own")
        if hf_class is not None:
            from fw.commands.scaffold.port import inspect_hf_class  # here: torch and transformers, --hf-class only

            spec, port = PORT, inspect_hf_class(hf_class)
    if name in set(taken):
        article = "an" if spec.title[0] in "aeiou" else "a"
        raise ConfigError(f"{article} {spec.title} named {name!r} is already installed; choose another NAME "
                          f"(`fw plugins list --kind {spec.registry_kind}` shows the names in use)")
    owner = _entry_point_owner(names.entry_point)
    if owner is not None:
        raise ConfigError(f"the entry-point name {names.entry_point!r} is already used by the installed "
                          f"distribution {owner!r}; choose another NAME")
    output = Path(output_dir)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {str(output)!r} is a file, not a directory")
    root = output / names.distribution
    if root.exists():
        raise ConfigError(f"{str(root)!r} already exists; choose another NAME or --output directory, "
                          "or remove it first")
    values = template_values(spec, names, port)
    files = {target.format(package=names.package): render(template, values)
             for template, target in spec.all_files().items()}
    write_files(root, files)
    return root


def _entry_point_owner(entry_point: str) -> str | None:
    """The distribution that already declares `fw` entry point `entry_point`, if any."""
    for ep in md.entry_points(group="fw", name=entry_point):
        dist = getattr(ep, "dist", None)
        return dist.metadata["Name"] if dist is not None else "unknown"
    return None


def _transformers_has(class_name: str) -> bool:
    import transformers  # here: as in port_values

    try:
        return getattr(transformers, class_name, None) is not None
    except Exception:  # a lazy-import failure inside transformers is not a name collision
        return False
