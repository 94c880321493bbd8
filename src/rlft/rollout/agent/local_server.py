"""An ASGI app served by uvicorn on 127.0.0.1 in a daemon thread of this process: the agent
endpoint (endpoint.py) and in-process OpenEnv apps (openenv_env.py)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from rlft.errors import ConfigError


def serve_in_thread(app: Any, name: str, what: str, **config: Any) -> tuple[Any, int]:
    """(the uvicorn server, its port) once it answers: a free port bound here and handed to uvicorn
    (no other process can take it in between); `what` names the app in the error if it does not
    start within 30 s."""
    import uvicorn  # lazy: the openai / openenv extras bring it

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=name, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise ConfigError(f"{what} did not start on 127.0.0.1:{port} (see the log above)")
        time.sleep(0.01)
    return server, port
