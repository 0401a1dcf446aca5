"""fw's C++ operator libraries, built by `pip install` (everything else is in pyproject.toml).

Each library is compiled once, at install, for the machine it is installed on (-march=native, as the
run-time build), with torch's BuildExtension, and lands beside its source as lib<name>.so with a record
of what it was built from (lib<name>.so.json); `fw.kernels.loader` loads it at run time and compiles nothing.
The run-time build stays as the fallback when a library is missing or stale.

torch must be importable when this runs, so install with `--no-build-isolation` after torch
(`./scripts/bootstrap.sh` does): `pip install --no-build-isolation -e .` or `... .`. torch is not a
build requirement in pyproject.toml on purpose: pip's isolated build would download another torch (the
default CUDA wheel) and build against it. Without torch at build time (an isolated build), or where a
library does not compile, fw installs without it and builds it at first use, as before.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent


def _load_cpp_build():
    """fw.kernels.build_record by path: fw is not importable while it is being built."""
    spec = importlib.util.spec_from_file_location("_fw_cpp_build", ROOT / "core" / "kernels" / "build_record.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cpp_build = _load_cpp_build()
_FP_CONTRACT_OFF = (*cpp_build.DEFAULT_CFLAGS, "-ffp-contract=off")

# (package, library, source, compiler flags): the flags each module loads its library with (a mismatch
# shows as a stale build; tests/test_cpp_install.py checks them). The cpu_paged attention plugin's kernel
# lives with the core's (fw.kernels): this file builds the distribution, as pyproject.toml's entry points do.
LIBRARIES = [
    ("fw.kernels", "cpu_ops", "core/kernels/cpu_ops.cpp", _FP_CONTRACT_OFF),
    ("fw.kernels", "dense_bf16", "core/kernels/dense_bf16.cpp", _FP_CONTRACT_OFF),
    ("fw.kernels", "packed_int", "core/kernels/packed_int.cpp", _FP_CONTRACT_OFF),
    ("fw.kernels", "fw_packed", "core/kernels/packed_linear.cpp", cpp_build.DEFAULT_CFLAGS),
    ("fw.kernels", "cpu_paged", "core/kernels/cpu_paged.cpp", cpp_build.DEFAULT_CFLAGS),
    ("fw.kernels", "step_program", "core/kernels/step_program.cpp", cpp_build.DEFAULT_CFLAGS),
]


def _say(message: str) -> None:
    print(f"fw: {message}", file=sys.stderr, flush=True)


def stale_libraries(root: Path = ROOT) -> list[str]:
    """The libraries whose in-place build (an editable install's) is missing or stale, with why; for
    scripts/bootstrap.sh, which reinstalls fw when this is not empty."""
    import torch

    stale = []
    for _, name, source, cflags in LIBRARIES:
        path = root / source
        library = cpp_build.installed_library(name, path)
        expected = cpp_build.record(name, path.read_text(), tuple(cflags), torch.__version__)
        why = cpp_build.stale_reason(cpp_build.read_record(library), expected) if library.is_file() else "missing"
        if why:
            stale.append(f"{name}: {why}")
    return stale


def _extensions_and_commands() -> tuple[list, dict]:
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        _say("torch is not importable while building fw (pip's build isolation?): installing without the "
             "C++ libraries, which are then built at first use. Install torch first and pass "
             "--no-build-isolation to build them now.")
        return [], {}

    if shutil.which("ninja") is None:  # the ninja wheel's binary, when the venv is not activated
        try:
            import ninja

            os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
        except ImportError:
            pass  # BuildExtension then compiles without it, more slowly

    by_extension = {}
    extensions = []
    built: set[str] = set()
    headers = [str(h.relative_to(ROOT)) for h in sorted(cpp_build.INCLUDE_DIR.glob("*.h"))]
    for package, name, source, cflags in LIBRARIES:
        ext = CppExtension(f"{package}.lib{name}", [source], include_dirs=[str(cpp_build.INCLUDE_DIR)],
                           depends=headers, extra_compile_args={"cxx": list(cflags)},
                           extra_link_args=["-fopenmp"])
        extensions.append(ext)
        by_extension[ext.name] = (name, ROOT / source, tuple(cflags))

    class BuildCppOps(BuildExtension.with_options(no_python_abi_suffix=True)):
        """Builds each library as the run-time build does, writes its record, and lets fw install without a
        library that fails to compile (it is then built, or its torch fallback used, at run time)."""

        def finalize_options(self) -> None:
            super().finalize_options()
            self.force = True  # the record names this torch and these flags: never keep an older build

        def build_extensions(self) -> None:
            # only -fPIC from Python's own CFLAGS (-g, -fwrapv, -Wall, -DNDEBUG): the same code as the
            # run-time build, whose flags are the library's alone
            self.compiler.set_executable("compiler_so", [self.compiler.compiler_so[0], "-fPIC"])
            _say(f"building {len(self.extensions)} C++ libraries for this CPU (-march=native), about 10 s each")
            super().build_extensions()

        def build_extension(self, ext) -> None:
            name, source, cflags = by_extension[ext.name]
            _say(f"building C++ library {name} ({source.relative_to(ROOT)})")
            try:
                super().build_extension(ext)
            except Exception as exc:  # noqa: BLE001  (a compiler error: fw still installs, and says so)
                _say(f"C++ library {name} did not build ({exc}); fw will build it at first use instead")
                return
            built.add(ext.name)
            self._write_record(ext)

        def copy_extensions_to_source(self) -> None:
            """An editable install: copy the libraries that built beside their sources, with their records."""
            every = self.extensions
            self.extensions = [ext for ext in every if ext.name in built]
            try:
                super().copy_extensions_to_source()
                for ext in self.extensions:
                    self._write_record(ext)  # self.inplace is set again: the path beside the source
            finally:
                self.extensions = every

        def _write_record(self, ext) -> None:
            name, source, cflags = by_extension[ext.name]
            library = Path(self.get_ext_fullpath(ext.name))
            cpp_build.write_record(library, cpp_build.record(name, source.read_text(), cflags, torch.__version__))

    return extensions, {"build_ext": BuildCppOps}


if __name__ == "__main__":  # pip's build backend runs this file as __main__; bootstrap.sh reads the table
    ext_modules, cmdclass = _extensions_and_commands()
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
