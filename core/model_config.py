"""Deprecated since plugin API 1.10: `ModelConfig` moved to `fw.model.config` (fw.model holds the model's config,
finding and loading). This module re-exports it, with a warning, until plugin API 2.0
(docs/plugin-api.md#deprecations)."""

from fw.model.config import DEFAULTS, ModelConfig, MoeConfig, RopeConfig  # noqa: F401
from fw.plugins.deprecation import warn_deprecated

warn_deprecated("fw.model_config", since="1.10", removed_in="2.0", instead="fw.model.config", stacklevel=2)
