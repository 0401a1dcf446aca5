"""One exception type per cause a user can trigger, each with an HTTP status.

Messages say what to do. The server maps `status_code`/`error_type` onto
OpenAI-style error bodies; the CLI prints the message without a traceback.
"""

from __future__ import annotations


class FwError(Exception):
    """Base of every error fw raises on purpose."""

    status_code: int = 500
    error_type: str = "internal_error"


class ConfigError(FwError):
    """A flag, config-file entry or environment variable has a bad value."""

    status_code = 400
    error_type = "invalid_request_error"


class PluginError(FwError):
    """A plugin could not be loaded or registered."""


class PluginLoadError(PluginError):
    """Raised in strict mode when any plugin failed to load."""


class DuplicatePluginNameError(PluginError):
    """Two plugins registered the same name for the same kind without override."""


class UnknownImplementationError(ConfigError):
    """A name was asked for (e.g. --attention-backend X) that no plugin registered."""


class UnsupportedConfigurationError(ConfigError):
    """An explicit choice exists but cannot run here; the message lists why and what would."""


class ModelLoadError(FwError):
    """A model file is missing, unreadable or inconsistent; the message names the file."""

    status_code = 400
    error_type = "invalid_request_error"


class UnsupportedArchitectureError(ModelLoadError):
    """No registered architecture plugin handles the model's `architectures`."""


class InvalidRequestError(FwError):
    """A request (prompt, sampling parameters) cannot be served as given."""

    status_code = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """Prompt plus max_tokens exceed the context the engine was started with."""


class DistributedError(FwError):
    """A multi-process engine lost a rank or could not assemble (fw.distributed): a worker died or
    stopped answering, or a rank did not join in time. The message names the rank, the address and
    what to check; the engine cannot step afterwards."""

    status_code = 503
    error_type = "service_unavailable"
