"""fw's C++ libraries built by `pip install` (setup.py): a start loads them and compiles nothing; a missing or
stale one falls back to the run-time build (fw.kernels.loader) and says so in one log line."""

from __future__ import annotations

import json
import logging
import os
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fw.kernels import build_record, loader
from fw.compile import ops as compile_ops
from fw.kernels import cpu_ops, dense, packed_int, step_program
from fw.backends.attention import cpu_paged

ROOT = Path(__file__).resolve().parent.parent

# what each module loads: (library, source, compiler flags)
LOADED = {
    "cpu_ops": (cpu_ops._SOURCE, cpu_ops._CFLAGS),
    "dense_bf16": (dense.BF16_SOURCE, dense.BF16_CFLAGS),
    "packed_int": (packed_int.SOURCE, packed_int.CFLAGS),
    "fw_packed": (compile_ops.PACKED_SOURCE, loader.DEFAULT_CFLAGS),
    "cpu_paged": (cpu_paged._SOURCE, loader.DEFAULT_CFLAGS),
    "step_program": (step_program._SOURCE, loader.DEFAULT_CFLAGS),
}


def setup_table() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """setup.py's LIBRARIES (read without running setup()): name -> (package, source, cflags)."""
    table = runpy.run_path(str(ROOT / "setup.py"))["LIBRARIES"]
    return {name: (package, source, tuple(cflags)) for package, name, source, cflags in table}


def test_setup_builds_each_library_as_its_module_loads_it() -> None:
    table = setup_table()
    assert set(table) == set(LOADED)
    for name, (package, source, cflags) in table.items():
        module_source, module_cflags = LOADED[name]
        assert cflags == module_cflags, name  # else every start would find the installed build stale
        assert (ROOT / source).name == module_source.name, name
        assert module_source.parent.name == package.rsplit(".", 1)[-1], name  # lib<name>.so lands beside it


def installed_or_why(name: str) -> tuple[Path | None, str]:
    source, cflags = LOADED[name]
    return loader.installed(name, source, cflags)


def test_this_install_built_every_library_for_this_torch_and_cpu() -> None:
    """The test environment was set up by scripts/bootstrap.sh (pip install --no-build-isolation): each library
    is installed, built with its flags for this torch. A source edited since the install (a kernel being worked
    on) and a venv carried to a machine with another CPU are allowed: both fall back to the run-time build."""
    allowed = ("its source changed since it was installed", "it was built on a CPU with other features")
    for name in LOADED:
        library, why = installed_or_why(name)
        assert library is not None or why.endswith(allowed), (
            f"{name}: {why}. Run ./scripts/bootstrap.sh (pip install --no-build-isolation -e .) to build it")


def test_a_start_loads_the_installed_libraries_and_builds_nothing(tmp_path) -> None:
    """In a fresh process on an empty fw cache, each library's own module loads it: from the install, with no
    log line and no build folder. (A library whose source was edited since the install is left out.)"""
    current = [name for name in LOADED if installed_or_why(name)[0] is not None]
    if not {"cpu_ops", "cpu_paged"} <= set(current):  # test_this_install_built_every_library... says why
        pytest.skip(f"the installed libraries are not current here: {[installed_or_why(n)[1] for n in LOADED]}")
    script = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="LOG %(levelname)s %(name)s %(message)s")
from fw.kernels import loader
from fw.kernels import cpu_ops, dense, packed_int, step_program
from fw.backends.attention import cpu_paged
from fw.compile import ops
load = {"cpu_ops": lambda: cpu_ops.prepare("cpu"), "dense_bf16": dense.bf16_kernel_ready, "packed_int": packed_int.ready,
        "cpu_paged": cpu_paged.load_kernel, "fw_packed": ops.load_packed_linear,
        "step_program": step_program.unavailable}
for name in sys.argv[1:]:
    load[name]()
print(json.dumps({name: loader.origin(name) for name in sys.argv[1:]}))
"""
    cache = tmp_path / "fw-cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("FW_")}
    r = subprocess.run([sys.executable, "-c", script, *current], env={**env, "FW_CACHE_DIR": str(cache)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    origins = json.loads(r.stdout.strip().splitlines()[-1])
    # dense_bf16 and packed_int load only on a CPU with AVX512-BF16 / -VNNI (None: not wanted here)
    assert {name: origin for name, origin in origins.items() if origin is not None} == {
        name: "installed" for name in current if origins[name] is not None}, r.stderr
    assert origins["cpu_ops"] == origins["cpu_paged"] == "installed"
    assert "LOG WARNING" not in r.stderr and "fw.kernels.loader" not in r.stderr, r.stderr
    assert not cache.exists(), list(cache.rglob("*"))  # no build folder: nothing compiled


def test_warm_cache_reports_an_installed_library_as_a_hit() -> None:
    from fw.warm import CppOpsArtifact

    source, cflags = LOADED["cpu_ops"]
    item, = CppOpsArtifact("cpu_ops", source, cflags).check(context=None)
    assert item.hit and item.detail == f"{build_record.installed_library('cpu_ops', source)} (installed)"


# -- the fallback, on a fake install in a temporary folder: nothing is compiled or loaded ---------------------


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """cpu_ops.cpp copied into a folder with an 'installed' build of it (a placeholder file and a current
    record), torch.ops.load_library and the run-time build replaced by recorders."""
    source = tmp_path / "pkg" / "fake_ops.cpp"
    source.parent.mkdir()
    shutil.copy(cpu_ops._SOURCE, source)
    library = build_record.installed_library("fake_ops", source)
    library.write_bytes(b"not a real library")
    cflags = loader.DEFAULT_CFLAGS
    build_record.write_record(library, build_record.record("fake_ops", source.read_text(), cflags, torch.__version__))
    calls = {"loaded": [], "built": []}

    def build(name, key, text, source_name, cflags, build_dir, target):
        calls["built"].append(target)
        target.write_bytes(b"a run-time build")

    monkeypatch.setenv("FW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(loader, "_loaded", {})
    monkeypatch.setattr(loader, "missing_toolchain", lambda: None)
    monkeypatch.setattr(loader, "_build_and_load", build)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: calls["loaded"].append(Path(path)))

    def load(caplog) -> tuple[str | None, list[logging.LogRecord]]:
        caplog.clear()
        loader._loaded.clear()  # as a new process
        with caplog.at_level(logging.INFO, logger="fw.kernels.loader"):
            assert loader.try_load_cpp_ops("fake_ops", source, cflags) is None
        return loader.origin("fake_ops"), [r for r in caplog.records if r.name == "fw.kernels.loader"]

    return source, library, calls, load, tmp_path / "cache"


def test_a_current_installed_library_is_loaded_silently(fake, caplog) -> None:
    source, library, calls, load, cache = fake
    origin, records = load(caplog)
    assert (origin, records, calls["loaded"], calls["built"]) == ("installed", [], [library], [])
    assert not cache.exists()


STALE = {
    "source": ("its source changed since it was installed", lambda s, lib: s.write_text(s.read_text() + "\n// edit\n")),
    "torch": ("built for torch 0.0.1", lambda s, lib: build_record.write_record(
        lib, {**build_record.read_record(lib), "torch": "0.0.1"})),
    "cflags": ("other compiler flags", lambda s, lib: build_record.write_record(
        lib, {**build_record.read_record(lib), "cflags": ["-O2"]})),
    "cpu": ("a CPU with other features", lambda s, lib: build_record.write_record(
        lib, {**build_record.read_record(lib), "cpu_flags_sha256": "another"})),
    "no record": ("build record is missing", lambda s, lib: build_record.record_path(lib).unlink()),
    "missing": ("no installed build", lambda s, lib: lib.unlink()),
}


@pytest.mark.parametrize("case", list(STALE))
def test_a_stale_or_missing_installed_library_falls_back_with_one_log_line(fake, caplog, case) -> None:
    source, library, calls, load, cache = fake
    phrase, spoil = STALE[case]
    spoil(source, library)
    origin, records = load(caplog)
    assert origin == "built" and len(calls["built"]) == 1 and calls["loaded"] == [], calls
    assert len(records) == 1 and records[0].levelno == logging.WARNING, [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert message.startswith("C++ ops fake_ops: ") and phrase in message and "building it now" in message, message
    assert calls["built"][0].parent.parent == cache / "fake_ops"

    origin, records = load(caplog)  # the next start loads that build from the cache, again in one line
    assert origin == "cache" and len(calls["built"]) == 1 and calls["loaded"] == [calls["built"][0]]
    assert len(records) == 1 and records[0].levelno == logging.INFO and phrase in records[0].getMessage()


def test_FW_CPP_OPS_INSTALLED_0_sets_the_installed_library_aside(fake, caplog, monkeypatch) -> None:
    source, library, calls, load, cache = fake
    monkeypatch.setenv("FW_CPP_OPS_INSTALLED", "0")
    origin, records = load(caplog)
    assert origin == "built" and len(records) == 1 and "FW_CPP_OPS_INSTALLED=0" in records[0].getMessage()


def test_without_a_toolchain_an_installed_library_is_still_available(fake, monkeypatch) -> None:
    source, library, calls, load, cache = fake
    monkeypatch.setattr(loader, "missing_toolchain", lambda: "no C++ compiler (c++/g++) on PATH")
    assert loader.unavailable("fake_ops", source) is None
    library.unlink()
    assert loader.unavailable("fake_ops", source) == "no C++ compiler (c++/g++) on PATH"
    why = loader.try_load_cpp_ops("fake_ops", source)
    assert "no C++ compiler" in why and "no installed build" in why and calls["built"] == []
