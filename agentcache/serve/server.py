"""Running the application: uvicorn on one port, drained on SIGTERM, the runtime closed after.

uvicorn's own graceful shutdown is the drain: on SIGTERM or SIGINT it stops accepting
connections, lets the requests in flight finish (streams included) for up to `drain_s`, then
returns; the runtime is closed after that, which saves the persisted anchor pools atomically.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

from agentcache.errors import InputError
from agentcache.runtime import Runtime
from agentcache.serve.app import create_app
from agentcache.serve.config import ServeConfig

__all__ = ["serve", "is_loopback"]

log = logging.getLogger("agentcache.serve")


def is_loopback(host: str) -> bool:
    """Whether `host` names only this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, config: ServeConfig) -> None:
    """Without API keys the server has one tenant and no authentication: loopback only."""
    if config.api_keys is None and not is_loopback(host):
        raise InputError(f"--host {host} would serve other machines without authentication: give --api-keys FILE "
                         "(a JSON object mapping each key to its tenant), or bind to 127.0.0.1")


def serve(runtime: Runtime, config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000,
          sock: socket.socket | None = None, log_level: str = "info") -> None:
    """Serve `runtime` until SIGTERM or SIGINT, drain, then close the runtime (saving its anchors)."""
    import uvicorn

    check_bind(host, config)
    app = create_app(runtime, config)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                           timeout_graceful_shutdown=config.drain_s, lifespan="off"))
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        runtime.close()  # saves the anchor pools when they persist
        log.info("agentcache serve: stopped")
