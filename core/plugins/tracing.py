"""`FW_TRACE_PLUGINS=1`: one log line per call into a plugin, with the plugin's name, a short
summary of the arguments (tensor shapes and dtypes, never values) and the duration.

Traced: importing each plugin module and its registration hooks (at load), and the calls into
the objects plugins provide that matter at run time: an architecture's `build` and the model's
`load_weights`; an attention backend's `prepare` and `forward`; a MoE kernel's `forward`; a
quantization method's factory, `create_weights`, `load_weight`, `process_weights_after_loading`
and `apply`; sampler stages' `apply`/`prepare` and the final choice's `choose`; a grammar
backend's factory, `compile` and mask fills; tool-call parser factories; plugin CLI commands.

Why it costs nothing when off: the plugin manager wraps a spec only when tracing is on, at
registration (`traced_spec`); with it off the registries hold the plugins' own objects and no
code here runs. Lines go to the `fw.plugins.trace` logger at INFO; `enable_logging` gives that
logger its own stderr handler (unless one is already attached), because `fw` configures logging
after plugins load and at WARNING, which would hide the load-time lines.

Durations are host time: on CUDA a kernel launch returns before the kernel finishes."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import sys
import time
from typing import Any, Callable, Iterable

from fw import env

TRACE_ENV = env.TRACE_PLUGINS.name
logger = logging.getLogger("fw.plugins.trace")

_MARK = "_fw_traced_by"  # set on instrumented objects and traced classes: never wrap twice


def enabled(environ: dict[str, str] | None = None) -> bool:
    """Whether FW_TRACE_PLUGINS asks for tracing (1, true, yes, on)."""
    return env.TRACE_PLUGINS.get(environ)


def enable_logging() -> None:
    """Make trace lines visible: the trace logger at INFO with its own stderr handler, unless
    someone attached a handler to it already (then theirs is used, and propagation left alone)."""
    logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("TRACE %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False  # `fw serve` also logs through the root: one copy of each line


# -- argument summaries -------------------------------------------------------------------------


def summarize(value: Any) -> str:
    """A short description of a value: tensors as dtype[shape] (and device when not CPU), the
    engine's per-step objects by their sizes, containers by length, small scalars as themselves."""
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return repr(value if len(value) <= 40 else value[:37] + "...")
    if isinstance(value, type):
        return value.__name__
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        device = getattr(value, "device", None)
        where = "" if device is None or getattr(device, "type", "cpu") == "cpu" else f"@{device}"
        return f"{str(dtype).removeprefix('torch.')}[{','.join(str(int(d)) for d in shape)}]{where}"
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"{type(value).__name__}[{len(value)}]"
    name = type(value).__name__
    if hasattr(value, "query_lens") and hasattr(value, "num_decodes"):  # AttentionMetadata
        return f"{name}(seqs={len(value.query_lens)}, decodes={value.num_decodes}, tokens={sum(value.query_lens)})"
    if hasattr(value, "params") and hasattr(value, "seqs") and hasattr(value, "vocab_size"):  # SamplingBatch
        return f"{name}(rows={len(value.params)})"
    if hasattr(value, "prefix") and hasattr(value, "input_size") and hasattr(value, "output_size"):  # Linear
        return f"{name}({value.prefix}, {value.input_size}->{value.output_size})"
    if hasattr(value, "num_experts") and hasattr(value, "intermediate_size"):  # FusedExperts
        return f"{name}({getattr(value, 'prefix', '?')}, experts={value.num_experts})"
    describe = getattr(value, "describe", None)
    if callable(describe) and hasattr(value, "kind"):  # a grammar Constraint
        try:
            return f"{name}({describe(40)})"
        except Exception:
            return name
    return name


def _arguments(names: tuple[str, ...], args: tuple, kwargs: dict) -> str:
    parts = [f"{n}={summarize(a)}" if n else summarize(a)
             for n, a in zip((*names, *[""] * max(0, len(args) - len(names))), args)]
    parts += [f"{k}={summarize(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _parameter_names(fn: Callable, skip_first: bool) -> tuple[str, ...]:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return ()
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    return names[1:] if skip_first else names


def log_call(plugin: str, call: str, arguments: str, result: str, seconds: float) -> None:
    """One trace line; `plugin`, `call` and `duration_ms` are also on the record for formatters."""
    ms = seconds * 1000.0
    logger.info("%s %s(%s) -> %s %.3f ms", plugin, call, arguments, result, ms,
                extra={"plugin": plugin, "call": call, "duration_ms": ms})


def timed(plugin: str, call: str, fn: Callable, *, skip_first: bool = False,
          result: Callable[[Any], Any] | None = None, describe: Callable[[Any], str] = summarize) -> Callable:
    """`fn` that logs each call. `skip_first` leaves out `self`/`cls` of an unbound method;
    `result(value)` may replace the return value (to instrument what a factory made)."""
    names = _parameter_names(fn, skip_first)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:
            elapsed = time.perf_counter() - start
            if logger.isEnabledFor(logging.INFO):
                log_call(plugin, call, _arguments(names, args[1:] if skip_first else args, kwargs),
                         f"raised {type(exc).__name__}", elapsed)
            raise
        elapsed = time.perf_counter() - start
        if logger.isEnabledFor(logging.INFO):
            log_call(plugin, call, _arguments(names, args[1:] if skip_first else args, kwargs), describe(value),
                     elapsed)
        return result(value) if result is not None else value

    return wrapper


# -- instrumenting what plugins provide -----------------------------------------------------------


class _TracedProxy:
    """Stands in for an object that takes no new attributes (`__slots__`): the traced methods,
    everything else read through. Used only where fw's own code is the sole caller."""

    __slots__ = ("_fw_target", "_fw_methods")

    def __init__(self, target: Any, methods: dict[str, Callable]):
        object.__setattr__(self, "_fw_target", target)
        object.__setattr__(self, "_fw_methods", methods)

    def __getattr__(self, name: str) -> Any:
        method = self._fw_methods.get(name)
        return method if method is not None else getattr(self._fw_target, name)

    def __repr__(self) -> str:
        return f"traced({self._fw_target!r})"


def instrument(obj: Any, plugin: str, label: str, methods: Iterable[str],
               results: dict[str, Callable[[Any], Any]] | None = None, proxy_ok: bool = False) -> Any:
    """Trace the named methods of `obj` (those it has) by shadowing them with instance attributes,
    so identity and isinstance stay as they were. An object that refuses attributes is returned
    as a proxy when `proxy_ok`, else untraced."""
    if obj is None or isinstance(obj, _TracedProxy) or getattr(obj, _MARK, None) is not None:
        return obj
    results = results or {}
    wrapped = {}
    for name in methods:
        fn = getattr(obj, name, None)
        if callable(fn):
            wrapped[name] = timed(plugin, f"{label}.{name}", fn, result=results.get(name))
    try:
        for name, fn in wrapped.items():
            setattr(obj, name, fn)
        setattr(obj, _MARK, plugin)
    except (AttributeError, TypeError):
        for name in wrapped:  # undo a partial instrumentation
            try:
                delattr(obj, name)
            except (AttributeError, TypeError):
                pass
        if proxy_ok:
            return _TracedProxy(obj, wrapped)
        logger.debug("cannot trace %s from %s: it takes no attributes", type(obj).__name__, plugin)
    return obj


def is_traced(obj: Any) -> bool:
    """Whether `obj` (an instrumented object, a proxy, or an instance of a traced class) reports its calls."""
    return isinstance(obj, _TracedProxy) or getattr(obj, _MARK, None) is not None


def traced_class(cls: type, plugin: str, label: str, methods: Iterable[str],
                 class_methods: Iterable[str] = ()) -> type:
    """A subclass of `cls` whose `methods` (called on instances) and `class_methods` (called on the
    class, like an attention backend's `prepare`) are traced; same name and module."""
    if getattr(cls, _MARK, None) is not None:
        return cls
    namespace: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                 "__doc__": cls.__doc__, _MARK: plugin}
    for name in methods:
        fn = getattr(cls, name, None)
        if callable(fn):
            namespace[name] = timed(plugin, f"{label}.{name}", fn, skip_first=True)
    for name in class_methods:
        fn = getattr(cls, name, None)  # bound to `cls`: runs exactly as it would untraced
        if callable(fn):
            namespace[name] = staticmethod(timed(plugin, f"{label}.{name}", fn))
    return type(cls)(cls.__name__, (cls,), namespace)


def _factory(plugin: str, label: str, factory: Callable, methods: tuple[str, ...], *, time_it: bool = True,
             results: dict[str, Callable[[Any], Any]] | None = None, proxy_ok: bool = False) -> Callable:
    """`factory` whose products are instrumented (and, with `time_it`, whose calls are traced)."""
    def make(value: Any) -> Any:
        return instrument(value, plugin, label, methods, results, proxy_ok)

    if time_it:
        return timed(plugin, f"{label}.factory", factory, result=make)

    @functools.wraps(factory)
    def quiet(*args, **kwargs):
        return make(factory(*args, **kwargs))

    return quiet


# -- per kind ---------------------------------------------------------------------------------------


def _label(spec) -> str:
    """What a call is made on: kind and implementation name, e.g. `sampler:top_k` (one plugin may
    register several implementations of a kind)."""
    return f"{spec.kind}:{spec.name}"


def _architecture(spec, plugin: str):
    label = _label(spec)

    def model(value: Any) -> Any:
        return instrument(value, plugin, label, ("load_weights",))

    fields = {"build": timed(plugin, f"{label}.build", spec.build, result=model)}
    if spec.rejection_reason is not None:
        fields["rejection_reason"] = timed(plugin, f"{label}.rejection_reason", spec.rejection_reason)
    return dataclasses.replace(spec, **fields)


def _attention_backend(spec, plugin: str):
    if not isinstance(spec.backend_cls, type):
        return spec
    return dataclasses.replace(spec, backend_cls=traced_class(spec.backend_cls, plugin, _label(spec),
                                                              ("forward",), ("prepare",)))


def _moe_kernel(spec, plugin: str):
    return dataclasses.replace(spec, kernel_cls=_factory(plugin, _label(spec), spec.kernel_cls,
                                                         ("forward", "process_weights_after_loading"), time_it=False))


_LINEAR_METHODS = ("create_weights", "load_weight", "process_weights_after_loading", "apply")


def _quantization_method(spec, plugin: str):
    label = _label(spec)

    def per_layer(method: Any) -> Any:
        from fw.layers.linear import UnquantizedLinearMethod  # torch is loaded by then

        if isinstance(method, UnquantizedLinearMethod):  # fw's own dense path, not the plugin's
            return method
        return instrument(method, plugin, label, _LINEAR_METHODS)

    return dataclasses.replace(spec, factory=_factory(plugin, label, spec.factory, (*_LINEAR_METHODS, "method_for"),
                                                      results={"method_for": per_layer}))


def _sampler(spec, plugin: str):
    return dataclasses.replace(spec, factory=_factory(plugin, _label(spec), spec.factory,
                                                      ("apply", "choose", "prepare"), time_it=False))


def _grammar_backend(spec, plugin: str):
    label = _label(spec)

    def matcher(value: Any) -> Any:
        return instrument(value, plugin, f"{label}.matcher", ("fill_bitmask",), proxy_ok=True)

    def compiled(value: Any) -> Any:
        return instrument(value, plugin, f"{label}.compiled", ("matcher",), {"matcher": matcher}, proxy_ok=True)

    def compiler(value: Any) -> Any:
        # A compiler with a batched fill gets its matchers back: they stay the compiler's own objects.
        results = {} if callable(getattr(value, "fill_bitmask_batch", None)) else {"compile": compiled}
        return instrument(value, plugin, label, ("compile", "fill_bitmask_batch"), results)

    return dataclasses.replace(spec, factory=timed(plugin, f"{label}.factory", spec.factory, result=compiler))


def _tool_parser(spec, plugin: str):
    return dataclasses.replace(spec, factory=timed(plugin, f"{_label(spec)}.factory", spec.factory))


def _cli_command(spec, plugin: str):
    return dataclasses.replace(spec, run=timed(plugin, f"{_label(spec)}.run", spec.run))


_BY_KIND = {
    "architecture": _architecture,
    "attention_backend": _attention_backend,
    "moe_kernel": _moe_kernel,
    "quantization_method": _quantization_method,
    "sampler": _sampler,
    "grammar_backend": _grammar_backend,
    "tool_parser": _tool_parser,
    "cli_command": _cli_command,
}


def traced_spec(spec: Any, plugin: str) -> Any:
    """`spec` with the calls into what it provides traced (a spec of an unknown kind as it is)."""
    wrap = _BY_KIND.get(getattr(spec, "kind", None))
    if wrap is None:
        return spec
    try:
        return wrap(spec, plugin)
    except Exception as exc:  # tracing must never break a plugin that works untraced
        logger.warning("cannot trace %s %r from %s: %s", spec.kind, getattr(spec, "name", "?"), plugin, exc)
        return spec


# -- loading ---------------------------------------------------------------------------------------


def traced_load(entry_point: Any, plugin: str) -> Any:
    """`entry_point.load()`, traced as the plugin's import."""
    return timed(plugin, "import", lambda module: entry_point.load(),
                 describe=lambda obj: "loaded")(entry_point.value)


def traced_hook(plugin: str, hook_name: str, fn: Callable, registered: Callable[[], list[str]]) -> Callable:
    """A registration hook implementation whose call is traced with what it registered."""
    def call(register) -> Any:
        start = time.perf_counter()
        try:
            return fn(register=register)
        finally:
            names = registered()
            log_call(plugin, hook_name, "register", ", ".join(names) if names else "nothing",
                     time.perf_counter() - start)

    return call
