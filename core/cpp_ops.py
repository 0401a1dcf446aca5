"""Deprecated since plugin API 1.10: fw's C++ loader moved to `fw.kernels.loader`, with fw's kernels. This
module re-exports it, with a warning, until plugin API 2.0 (docs/plugin-api.md#deprecations)."""

from fw.kernels.loader import (DEFAULT_CFLAGS, INCLUDE_DIR, installed, is_built, is_loaded,  # noqa: F401
                               library_path, load_cpp_ops, missing_toolchain, origin, try_load_cpp_ops, unavailable)
from fw.plugins.deprecation import warn_deprecated

warn_deprecated("fw.cpp_ops", since="1.10", removed_in="2.0", instead="fw.kernels.loader", stacklevel=2)
