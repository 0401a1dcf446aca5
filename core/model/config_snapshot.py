"""transformers' reading of a model config, kept as JSON and read back without transformers.

Why: building a config through transformers' classes imports transformers and the model's config
module (over a second per start, more on a busy machine), and for unchanged files the result is
always the same. The first load builds the config with transformers and records every plain
attribute it has (its `to_dict()` and the properties beside it, such as `rope_scaling` or
`num_labels`); later starts get a `ConfigView` of that record. Attributes whose values are not plain
data (sub-config objects, sets) are not recorded: reading one loads the real config, as does
`transformers_config()` for code that needs the object itself (the transformers fallback
architecture). Remote-code configs always go through transformers."""

from __future__ import annotations

import copy
import json
import os
from typing import Any, Callable

from fw.model.derived_cache import entry_dir

SNAPSHOT_VERSION = 2
_DTYPE_KEYS = ("dtype", "torch_dtype")
# Deprecated aliases transformers warns about when read: not recorded (reading one goes to the real config).
_DEPRECATED = ("torch_dtype", "use_return_dict")


def _revive(name: str, value: Any) -> Any:
    """A recorded value as the config holds it: a torch dtype from its name, id2label's int keys."""
    if isinstance(value, dict) and set(value) == {"torch_dtype"}:
        import torch  # here: reading a snapshot must not import torch (start-up time)

        return getattr(torch, value["torch_dtype"])
    if name == "id2label" and isinstance(value, dict):
        return {int(k): v for k, v in value.items()}
    return value


def _plain(name: str, value: Any) -> bool:
    """Whether `value` comes back equal (and of the same types) from JSON."""
    try:
        back = _revive(name, json.loads(json.dumps(value)))
    except (TypeError, ValueError):
        return False
    return back == value and json.dumps(back, sort_keys=True) == json.dumps(value, sort_keys=True) \
        and type(back) is type(value)


def record(config: Any) -> dict:
    """The plain attributes of a transformers config, what `ConfigView` answers with."""
    values: dict[str, Any] = {}
    others: list[str] = []
    for name in sorted(set(dir(config)) | set(config.to_dict())):
        if name.startswith("__"):
            continue
        if name in _DEPRECATED:
            others.append(name)
            continue
        try:
            value = getattr(config, name)
        except Exception:
            others.append(name)
            continue
        if callable(value) and not isinstance(value, type):
            continue
        if name in _DTYPE_KEYS and value is not None and not isinstance(value, str):
            values[name] = {"torch_dtype": str(value).removeprefix("torch.")}
        elif _plain(name, value):
            values[name] = value
        else:
            others.append(name)
    as_dict = config.to_dict()
    if "dtype" in as_dict and not isinstance(as_dict["dtype"], (str, type(None))):
        as_dict["dtype"] = str(as_dict["dtype"]).removeprefix("torch.")
    return {"version": SNAPSHOT_VERSION, "class": type(config).__name__, "values": values, "dict": as_dict,
            "attribute_map": dict(getattr(config, "attribute_map", {}) or {}), "others": others}


class ConfigView:
    """A transformers config's recorded attributes, read like the config itself (attribute access,
    `attribute_map` aliases, `to_dict()`), and written to like it (the loader unties a head)."""

    def __init__(self, snapshot: dict, load_transformers: Callable[[], Any]):
        object.__setattr__(self, "_snapshot", snapshot)
        object.__setattr__(self, "_changed", {})  # attributes set on this view
        object.__setattr__(self, "_load", load_transformers)
        object.__setattr__(self, "_real", None)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_snapshot", "_changed", "_load", "_real"):
            raise AttributeError(name)
        snapshot = self._snapshot
        key = snapshot["attribute_map"].get(name, name)
        if key in self._changed:
            return self._changed[key]
        if key in snapshot["values"]:
            return _revive(key, snapshot["values"][key])
        if key in snapshot["others"]:
            return getattr(self.transformers_config(), key)
        raise AttributeError(f"{snapshot['class']} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        key = self._snapshot["attribute_map"].get(name, name)
        self._changed[key] = value
        if self._real is not None:
            setattr(self._real, key, value)

    def __deepcopy__(self, memo: dict) -> "ConfigView":
        view = ConfigView(self._snapshot, self._load)
        object.__setattr__(view, "_changed", copy.deepcopy(self._changed, memo))
        return view

    def __reduce__(self):
        return (_restore, (self._snapshot, self._changed))

    def to_dict(self) -> dict:
        """transformers' to_dict(): the recorded attributes it holds, with what was set on this view."""
        values = {k: v if k != "id2label" else _revive(k, v) for k, v in self._snapshot["dict"].items()}
        return copy.deepcopy({**values, **self._changed})

    def transformers_config(self) -> Any:
        """The transformers config object itself (built on first use: imports transformers), with any
        attribute set on this view set on it too."""
        if self._real is None:
            real = self._load()
            for key, value in self._changed.items():
                setattr(real, key, value)
            object.__setattr__(self, "_real", real)
        return self._real

    def __repr__(self) -> str:
        return f"ConfigView({self._snapshot['class']}, model_type={self._snapshot['values'].get('model_type')!r})"


def _restore(snapshot: dict, changed: dict) -> ConfigView:
    def unavailable():
        raise RuntimeError("this config was copied into another process; its transformers object is not available")

    view = ConfigView(snapshot, unavailable)
    object.__setattr__(view, "_changed", dict(changed))
    return view


def cached_config(kind: str, key: str, build: Callable[[], Any]) -> ConfigView:
    """The ConfigView recorded under `kind`/`key` in fw's cache, else `build()` (a transformers config)
    recorded there now. `build` also serves `transformers_config()` later. A config class from outside
    transformers (an architecture plugin's) is returned as built and never recorded."""
    path = entry_dir(kind, key + ".json")
    try:
        snapshot = json.loads(path.read_text())
        if snapshot.get("version") == SNAPSHOT_VERSION:
            return ConfigView(snapshot, build)
    except (OSError, json.JSONDecodeError):
        pass
    real = build()
    if not type(real).__module__.startswith("transformers."):
        return real  # a plugin's own config class (its properties and methods) is not recorded
    snapshot = record(real)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(snapshot))
    os.replace(tmp, path)
    view = ConfigView(snapshot, build)
    object.__setattr__(view, "_real", real)
    return view

