"""`fw serve`: the OpenAI-compatible server (FastAPI + uvicorn) over one engine."""

from __future__ import annotations

import argparse
import errno
import logging
import signal
import socket
import sys
import threading
from pathlib import Path

from fw.config import EngineConfig, add_config_arguments, resolve_config
from fw.default_model import default_model
from fw.errors import ConfigError
from fw.server.config import ServerConfig
from fw.warm.startup import mark_ready, resume_collector

NAME = "serve"
HELP = "Serve a model over an OpenAI-compatible HTTP API."


def configure(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, ServerConfig, title="server options")
    add_config_arguments(p)


def served_names(config, model_arg: str | None, source_path: Path) -> list[str]:
    """--served-model-name values, else a readable default: a hub id as given, a local
    directory's or .gguf file's name (without .gguf)."""
    if config.served_model_name:
        return list(dict.fromkeys(config.served_model_name))
    if model_arg is None or Path(model_arg).expanduser().exists():
        return [source_path.name.removesuffix(".gguf")]
    return [model_arg]


def run(args: argparse.Namespace) -> int:
    engine_config = resolve_config(cli=vars(args), config_file=args.config, shares_file_with=(ServerConfig,))
    server_config = resolve_config(cli=vars(args), config_file=args.config, cls=ServerConfig,
                                   shares_file_with=(EngineConfig,))
    from fw.distributed.backend import prepare_process  # here: torch (1 s); `fw --help` imports this module

    # --distributed-executor-backend: under torchrun (external_launcher) ranks other than 0 become workers here
    engine_config = prepare_process(engine_config)
    if engine_config.node_rank > 0:  # this machine runs tensor-parallel workers only; node 0 serves
        from fw.distributed.node import run_node  # here: as above

        return run_node(engine_config)
    # before the imports and the model load: a port in use fails in a fraction of a second
    sock = listening_socket(server_config.host, server_config.port)

    import uvicorn  # here: after the port check, which fails in a fraction of a second; not for `fw --help`

    # here: as above (the engine, torch, fastapi)
    from fw.distributed.data_parallel import DataParallelEngine
    from fw.engine.factory import create_engine
    from fw.server.app import build_app
    from fw.server.async_engine import AsyncEngine
    from fw.server.metrics import ServerMetrics
    from fw.server.state import ServerState
    from fw.plugins.manager import get_plugin_manager
    from fw.server.tools.plan import check_tool_parser_flag

    _configure_logging(server_config.json_logs, args.log_level)
    model_arg = engine_config.model
    if engine_config.model is None:
        engine_config.model = default_model()
    # A mistyped --tool-call-parser fails now, not at the first tool request after a model load.
    check_tool_parser_flag(get_plugin_manager().registry("tool_parser"), engine_config.tool_call_parser)
    print(f"fw: loading {engine_config.model} ...", file=sys.stderr, flush=True)
    if engine_config.data_parallel_size > 1:  # replicas in processes of their own, replica 0 in this one
        engine = DataParallelEngine.start(engine_config, create_engine)
    else:
        engine = create_engine(engine_config)  # LLMEngine, or fw.pooling's EncoderEngine for an encoder
    names = served_names(server_config, model_arg, engine.loaded.source.path)
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(names[0], engine.loaded.attention.chosen.name, lambda: async_engine.stats,
                            startup=engine.startup_report)
    state = ServerState(async_engine, server_config, names, metrics)

    async def on_shutdown() -> None:
        await async_engine.drain(server_config.shutdown_timeout)

    app = build_app(state, on_shutdown)
    grace = max(1, int(server_config.shutdown_timeout))  # uvicorn's unit: whole seconds
    config = uvicorn.Config(app, host=server_config.host, port=server_config.port, log_config=None,
                            timeout_graceful_shutdown=grace,
                            access_log=server_config.log_requests)
    server = uvicorn.Server(config)
    _announce_when_ready(server, server_config, names[0], getattr(engine, "pooling", None) is not None)
    _end_streams_before_the_deadline(server, state, grace)
    _graceful_sigterm_exits_zero()
    _exit_when_the_engine_dies(server, async_engine)
    resume_collector()  # paused by `fw` for this start-up (fw.cli.main.STARTS_AN_ENGINE)
    server.run(sockets=[sock])
    if async_engine.dead is not None:
        print(f"fw: error: {async_engine.dead}", file=sys.stderr, flush=True)
        return 1
    return 0


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (uvicorn listens on it once the model is loaded). Where the address is
    taken or not this machine's, a ConfigError names the flag instead of uvicorn's errno after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses a TIME_WAIT port
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port}: the port is already in use on {host}; stop what listens there "
                              f"or pass another --port") from None
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})") from None
    return sock


def _graceful_sigterm_exits_zero() -> None:
    """uvicorn catches SIGTERM, shuts down gracefully, restores the handler it found and raises the
    signal again, which would kill the process (exit -15) after a clean shutdown. The handler it
    restores is this no-op, so `run` returns and `fw serve` exits 0, as a supervisor expects."""
    signal.signal(signal.SIGTERM, lambda signum, frame: None)


# How long a dead engine's server still answers (/health 503, requests 503) before it shuts down: enough for
# the failed streams' error events to reach their clients and for a health probe to see why.
DEAD_ENGINE_LINGER_S = 2.0


def _exit_when_the_engine_dies(server, async_engine) -> None:
    """A lost rank leaves an engine that can never step (issue 22): shut the server down (its workers are
    stopped already; the engine's close stops the rest) and let `run` return non-zero, so a supervisor
    restarts it instead of routing traffic to a server that can only fail."""
    def shut_down_soon(why: str) -> None:
        logging.getLogger("fw.server").error("shutting down in %.0f s: the engine is dead (%s)",
                                             DEAD_ENGINE_LINGER_S, why)
        timer = threading.Timer(DEAD_ENGINE_LINGER_S, lambda: setattr(server, "should_exit", True))
        timer.daemon = True
        timer.start()

    async_engine.on_dead = shut_down_soon


def _announce_when_ready(server, config, name: str, embeds: bool = False) -> None:
    """Print where to reach the server, with a ready-to-paste curl line, once it listens. The line
    sets max_tokens and temperature 0: at OpenAI's default temperature a small model may ramble to
    the context limit. With --api-key the line reads the key from $FW_API_KEY: stdout is often a
    log, and a secret never goes into one."""
    original = server.startup

    async def startup(sockets=None) -> None:
        await original(sockets=sockets)
        if server.started:
            mark_ready()  # logs `startup: ready N s after process start`
            host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else config.port
            auth = ' -H "Authorization: Bearer $FW_API_KEY"' if config.api_key else ""
            key_note = " (set FW_API_KEY to the server's API key)" if config.api_key else ""
            if embeds:  # an embedding model (--task embed): the curl line embeds
                route = "embeddings"
                body = f"{{\"model\": \"{name}\", \"input\": [\"What is the capital of France?\"]}}"
            else:
                route, body = "chat/completions", (
                    f"{{\"model\": \"{name}\", \"messages\": [{{\"role\": \"user\", \"content\": "
                    f"\"What is the capital of France?\"}}], \"max_tokens\": 32, \"temperature\": 0}}")
            print(f"fw: serving {name} at http://{host}:{port}/v1 (OpenAI API){key_note}\n"
                  f"curl http://{host}:{port}/v1/{route} -H 'Content-Type: application/json'{auth} "
                  f"-d '{body}'", flush=True)

    server.startup = startup


def _end_streams_before_the_deadline(server, state, timeout: int) -> None:
    """On SIGTERM/SIGINT uvicorn waits up to --shutdown-timeout for open connections, then cancels
    them: a stream still running would end mid-answer with no word why. Half a second before that
    deadline, each unfinished stream is ended with a 503 `service_unavailable` error event and
    [DONE] instead (its request aborted), so a client can tell a shutdown from a network fault."""
    import asyncio  # here: 30 ms that `fw --help` (which imports this module) does not pay

    from fw.server.state import ShuttingDownError  # here: the server's modules load with `fw serve`'s engine

    original = server.shutdown

    async def end_streams() -> None:
        await asyncio.sleep(max(0.0, timeout - 0.5))
        error = ShuttingDownError(f"the server shut down before this request finished (--shutdown-timeout "
                                  f"{timeout} s ran out); retry it on another replica")
        if count := state.engine.fail_streams(error):
            logging.getLogger("fw.server").warning("shutdown: ended %d unfinished stream(s) with an error", count)

    async def shutdown(sockets=None) -> None:
        state.draining = True  # refuse new requests from now, not only once the connections are gone
        timer = asyncio.ensure_future(end_streams())
        try:
            await original(sockets=sockets)
        finally:
            timer.cancel()

    server.shutdown = shutdown


def _configure_logging(json_logs: bool, level: str) -> None:
    from fw.server.app import JsonLogFormatter  # here: as in _end_streams_before_the_deadline (fastapi)

    handler = logging.StreamHandler()
    if json_logs:
        handler.setFormatter(JsonLogFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper() if level.upper() != "WARNING" else "INFO")
