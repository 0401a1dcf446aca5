"""Server options, declared once like the engine's: each field is a `fw serve`
flag, an `FW_*` variable and a `--config` YAML key (names follow TGI and vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fw.errors import ConfigError


def _opt(help: str, **extra) -> dict:
    return {"help": help, **extra}


@dataclass
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata=_opt("Address to listen on (0.0.0.0 for all interfaces)."))
    port: int = field(default=8000, metadata=_opt("TCP port."))
    served_model_name: list[str] = field(default_factory=list, metadata=_opt(
        "Name(s) clients use for the model (repeatable; the first is listed first). "
        "Default: the model's directory or file name.", repeatable=True))
    api_key: str | None = field(default=None, repr=False, metadata=_opt(  # repr=False: a secret stays out of logs
        "Require `Authorization: Bearer KEY` on every route but /health, /metrics, /version and the API schema "
        "(also FW_API_KEY)."))
    max_concurrent_requests: int = field(default=128, metadata=_opt(
        "Requests in flight at most; more get HTTP 429 at once."))
    max_queue_size: int | None = field(default=None, metadata=_opt(
        "Requests waiting for the engine at most (not yet running); more get HTTP 429."))
    max_input_tokens: int | None = field(default=None, metadata=_opt(
        "Longest prompt accepted, in tokens; default: the engine's --max-length minus one."))
    payload_limit: int = field(default=2_000_000, metadata=_opt("Largest request body in bytes (HTTP 413 above)."))
    shutdown_timeout: float = field(default=30.0, metadata=_opt(
        "On SIGTERM/SIGINT: seconds to let running requests finish before aborting them."))
    log_requests: bool = field(default=False, metadata=_opt(
        "Log every request (id, sizes, parameters).", negated_aliases=(("--disable-log-requests", "vLLM"),)))
    json_logs: bool = field(default=False, metadata=_opt("Write logs as JSON lines.",
                                                         aliases=(("--json-output", "TGI"),)))
    enable_echo: bool = field(default=True, metadata=_opt(
        "echo in /v1/completions: the prompt returned before each completion, with its logprobs when asked "
        "(lm-eval-harness's loglikelihood). On by default, as in vLLM; off: a request with echo is refused "
        "(400). MAX's name; off by default in MAX."))
    ui: bool = field(default=True, metadata=_opt(
        "Serve the chat page at / (static files shipped with fw; its API calls carry the key). --no-ui: / is a 404."))

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ConfigError(f"--port must be 0..65535, got {self.port}")
        if self.max_concurrent_requests < 1:
            raise ConfigError(f"--max-concurrent-requests must be at least 1, got {self.max_concurrent_requests}")
        if self.max_queue_size is not None and self.max_queue_size < 0:
            raise ConfigError(f"--max-queue-size must be at least 0, got {self.max_queue_size}")
        if self.payload_limit < 1024:
            raise ConfigError(f"--payload-limit must be at least 1024 bytes, got {self.payload_limit}")
