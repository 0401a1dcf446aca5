"""The `FW_*` environment switches that are not engine options, each declared once: its name, type,
default and meaning. Every module reads them through this one (tests/test_env.py checks that no other
module reads an `FW_*` variable), and docs/flags.md lists them from `SWITCHES`.

Why apart from `fw.config`: engine and server options get their `FW_<NAME>` variables derived from
`EngineConfig` (a flag declared once yields its variable); these switches act below the engine
(where fw keeps its cache, which CPU kernels run, which plugins load) or before a config exists, so
they have no flag. A value a switch cannot read is a `ConfigError` naming the variable and what it
takes, never silently the default.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from fw.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    """One `FW_*` variable. `raw()` is its value, stripped, or None when unset or blank."""

    name: str
    doc: str

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        value = (os.environ if environ is None else environ).get(self.name)
        return value.strip() if value is not None and value.strip() else None

    def _refuse(self, value: str, takes: str) -> ConfigError:
        return ConfigError(f"{self.name}={value!r}: expected {takes}; unset it for the default")

    @property
    def kind(self) -> str:
        return "text"

    @property
    def default_text(self) -> str:
        return "unset"


@dataclass(frozen=True)
class Flag(Switch):
    """On or off: 1/true/yes/on or 0/false/no/off (any case); unset or blank: `default`."""

    default: bool = False

    def get(self, environ: Mapping[str, str] | None = None) -> bool:
        value = self.raw(environ)
        if value is None:
            return self.default
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise self._refuse(value, f"one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE)} (off)")

    @property
    def kind(self) -> str:
        return "on/off"

    @property
    def default_text(self) -> str:
        return "on" if self.default else "off"


@dataclass(frozen=True)
class Choice(Switch):
    """One of `values` (any case); `aliases` spell some of them otherwise (`"0"` for `"off"`)."""

    values: tuple[str, ...] = ()
    default: str = ""
    aliases: tuple[tuple[str, str], ...] = ()

    def get(self, environ: Mapping[str, str] | None = None) -> str:
        value = self.raw(environ)
        if value is None:
            return self.default
        word = dict(self.aliases).get(value.lower(), value.lower())
        if word not in self.values:
            spelled = ", ".join(f"{a} ({v})" for a, v in self.aliases)
            raise self._refuse(value, f"one of {', '.join(self.values)}" + (f", or {spelled}" if spelled else ""))
        return word

    @property
    def kind(self) -> str:
        return " \\| ".join(f"`{v}`" for v in self.values)

    @property
    def default_text(self) -> str:
        return f"`{self.default}`"


@dataclass(frozen=True)
class Names(Switch):
    """A comma-separated list of names; unset or blank: None (no list given)."""

    def get(self, environ: Mapping[str, str] | None = None) -> set[str] | None:
        value = self.raw(environ)
        return None if value is None else {p.strip() for p in value.split(",") if p.strip()}

    @property
    def kind(self) -> str:
        return "names, comma-separated"


@dataclass(frozen=True)
class Text(Switch):
    """Free text (a path); unset or blank: None."""

    def get(self, environ: Mapping[str, str] | None = None) -> str | None:
        return self.raw(environ)

    @property
    def kind(self) -> str:
        return "path"


CACHE_DIR = Text("FW_CACHE_DIR", "Where fw keeps what it derives once and reuses (converted GGUF tokenizers, built C++ "
                 "kernels, repacked weights, kept grammars, compile caches); default `~/.cache/fw`.")
CONFIG = Text("FW_CONFIG", "A YAML file of engine and server options, as `--config` (which wins).")
PLUGINS = Names("FW_PLUGINS", "Load only these plugins (entry-point or distribution names; the built-ins are `fw`).")
DISABLE_PLUGINS = Names("FW_DISABLE_PLUGINS", "Never load these plugins (entry-point or distribution names).")
STRICT_PLUGINS = Flag("FW_STRICT_PLUGINS", "A plugin that fails to load is an error: the engine option "
                      "`--strict-plugins`'s variable, read here where no engine configuration exists (`fw plugins "
                      "list`, a `PluginManager()` of its own).")
TRACE_PLUGINS = Flag("FW_TRACE_PLUGINS", "Log every call into plugin code with its time (docs/plugin-authors/"
                     "loading.md).")
CPP_OPS_INSTALLED = Flag("FW_CPP_OPS_INSTALLED", "Load the C++ libraries `pip install` built; off: build (or reuse) "
                         "them under the cache dir at run time.", default=True)
CPU_FUSED_OPS = Flag("FW_CPU_FUSED_OPS", "fw's fused C++ CPU ops (norms, rotary, argmax, ...); off: torch's.",
                     default=True)
CPU_STEP_PROGRAM = Flag("FW_CPU_STEP_PROGRAM", "CPU steps replay the decoder layers' op calls from C++ "
                        "(fw.layers.replay); off: the layers' Python forward.", default=True)
CPU_PACKED_INT = Flag("FW_CPU_PACKED_INT", "Quantized weights run on CPU kernels (fw's packed-int ones, a library's "
                      "own fused kernel); off: every method's reference path.", default=True)
CPU_WEIGHT_PACKING = Choice("FW_CPU_WEIGHT_PACKING", "Dense CPU weights: `auto` packs bf16 ones for fw's kernel on "
                            "CPUs with AVX512-BF16 and the rest in oneDNN's layout, `onednn` packs bf16 for oneDNN "
                            "too, `off` keeps torch's layout (F.linear).",
                            values=("auto", "onednn", "off"), default="auto",
                            aliases=(("1", "auto"), ("true", "auto"), ("yes", "auto"), ("on", "auto"),
                                     ("0", "off"), ("false", "off"), ("no", "off")))
CPU_RUNTIME_TUNING = Flag("FW_CPU_RUNTIME_TUNING", "On Linux CPUs, tune malloc, OpenMP and huge pages for serving "
                          "(docs/performance.md).", default=True)
DIST_SHM = Flag("FW_DIST_SHM", "Tensor-parallel ranks on one CPU machine all-reduce through shared memory; off: "
                "gloo.", default=True)
BNB_INT8_MATMUL = Flag("FW_BNB_INT8_MATMUL", "bitsandbytes-8bit runs bitsandbytes' own LLM.int8 matmul on any "
                       "device (its CUDA default).")

SWITCHES: tuple[Switch, ...] = (CACHE_DIR, CONFIG, PLUGINS, DISABLE_PLUGINS, STRICT_PLUGINS, TRACE_PLUGINS,
                                CPP_OPS_INSTALLED, CPU_FUSED_OPS, CPU_STEP_PROGRAM, CPU_PACKED_INT, CPU_WEIGHT_PACKING,
                                CPU_RUNTIME_TUNING, DIST_SHM, BNB_INT8_MATMUL)
