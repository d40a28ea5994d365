"""``background_server(app)``: uvicorn serving ``app`` on a loopback port, in a thread, for
as long as the ``with`` block runs (``kvcanary bench serve`` and the HTTP tests use it)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI


@contextlib.contextmanager
def background_server(app: FastAPI, host: str = "127.0.0.1", start_timeout_s: float = 60.0) -> Iterator[str]:
    """Yield the server's base URL (``http://127.0.0.1:PORT``, a free port); on exit the
    server shuts down (the app's lifespan stops its engine loop)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on",
                                           timeout_graceful_shutdown=5))  # fmt: skip
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="kvcanary-http",
                              daemon=True)  # fmt: skip
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError(f"the HTTP server on {host}:{port} did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
