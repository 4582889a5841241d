"""Running an `OpenAIServer` on a real socket with uvicorn: in the foreground (`trtssd serve`) or
in a background thread (tests, benchmarks, notebooks).

The socket is bound here, before uvicorn starts, so port 0 (an ephemeral port) works and the
address is known before the first request.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

import uvicorn

from trtssd.serving.openai_server import OpenAIServer

log = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 30  # how long open streams may finish once asked to stop (Ctrl-C, SIGTERM)


def bind(host: str, port: int) -> socket.socket:
    """A socket listening from here on (SO_REUSEADDR set): a client that connects as soon as the
    address is logged waits in the backlog until uvicorn accepts (uvicorn would only listen once
    its start-up is done, and such a client was refused)."""
    ipv6 = ":" in host
    return socket.create_server((host, port), family=socket.AF_INET6 if ipv6 else socket.AF_INET, backlog=2048,
                                dualstack_ipv6=ipv6 and socket.has_dualstack_ipv6())


def _uvicorn(server: OpenAIServer, graceful_s: int, access_log: bool) -> uvicorn.Server:
    # log_config=None: uvicorn logs through the logging set up by the program, not its own.
    config = uvicorn.Config(server.app, log_config=None, access_log=access_log, timeout_graceful_shutdown=graceful_s)
    return uvicorn.Server(config)


def serve_forever(server: OpenAIServer, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, let open streams finish, stop the engine and return (call
    from the main thread; the caller then closes the LLM, which ends the draft rank)."""
    sock = bind(host, port)
    address = sock.getsockname()
    log.warning("serving %s on http://%s:%d (OpenAI API under /v1, /health, /metrics)",
                server.model.name, address[0], address[1])
    # uvicorn handles both signals while it serves, then raises the one it got again with the
    # handler it found. SIGTERM's default would end the process on the spot, leaving the draft
    # rank behind: this handler turns it into the KeyboardInterrupt SIGINT gives, caught below.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    server.start()
    try:
        _uvicorn(server, GRACEFUL_SHUTDOWN_S, access_log=True).run(sockets=[sock])
    except KeyboardInterrupt:
        log.warning("stopping")
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()
        sock.close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


class BackgroundServer:
    """An `OpenAIServer` on ``host:port`` in a daemon thread; ``url`` once started.

        with BackgroundServer(OpenAIServer(llm, "m")) as bg:
            httpx.get(bg.url + "/health")
    """

    def __init__(self, server: OpenAIServer, host: str = "127.0.0.1", port: int = 0, start_timeout_s: float = 30.0):
        self.server = server
        self._sock = bind(host, port)
        host, port = self._sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._uvicorn = _uvicorn(server, graceful_s=5, access_log=False)
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._sock]},
                                        name="trtssd-http", daemon=True)
        server.start()
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop the engine (pending requests fail) and the HTTP server (idempotent)."""
        self.server.close()
        self._uvicorn.should_exit = True
        self._thread.join(10)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
