"""Running the application: uvicorn on one port, drained on SIGTERM, the runtime closed after.

uvicorn's own graceful shutdown is the drain: on SIGTERM or SIGINT it stops accepting
connections, lets the requests in flight finish (streams included) for up to `drain_s`, then
returns; the runtime is closed after that, which saves the persisted anchor pools atomically.
The app's `Drain` is begun at the same moment, so a stream still running near the end closes
with an error event and `[DONE]` (`serve.drain`) instead of being cut.
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import threading
import time

from agentcache.errors import InputError
from agentcache.runtime import Runtime
from agentcache.serve.app import create_app
from agentcache.serve.config import ServeConfig

__all__ = ["serve", "is_loopback", "check_bind", "ServerThread"]

log = logging.getLogger(__name__)


def _stopped(_signal: int, _frame: object) -> None:
    raise SystemExit(0)


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
    server = _draining_server(app, uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                                  timeout_graceful_shutdown=config.drain_s, lifespan="off"))
    # uvicorn drains, then raises the signal again under the handler it found: ours ends the process
    # through the `finally` below (a plain SIGTERM would end it before the anchors are saved)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _stopped) if main_thread else None
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        runtime.close()  # saves the anchor pools when they persist
        log.info("agentcache serve: stopped")


def _draining_server(app, config):
    """A uvicorn server that begins the app's `Drain` when a signal stops it."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            app.state.drain.begin(config.timeout_graceful_shutdown or 0.0)
            super().handle_exit(sig, frame)

    return DrainingServer(config)


class ServerThread:
    """An application served on a free loopback port by a thread of this process (tests,
    benchmarks, notebooks): `with ServerThread(app) as server: OpenAI(base_url=server.url)`."""

    def __init__(self, app, *, drain_s: float = 5.0) -> None:
        import uvicorn

        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.server = _draining_server(app, uvicorn.Config(app, log_level="warning", access_log=False,
                                                           lifespan="off", timeout_graceful_shutdown=drain_s))
        self._drain_s = drain_s
        self._app = app
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                        name="agentcache-serve", daemon=True)

    def __enter__(self) -> "ServerThread":
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._app.state.drain.begin(self._drain_s)
        self.server.should_exit = True
        self._thread.join(60)
        self._socket.close()
