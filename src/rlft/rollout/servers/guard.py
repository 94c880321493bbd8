"""The ASGI middleware `rlft serve` adds to vLLM's server (`--middleware`): the key on every route.

vLLM's own `--api-key` checks only the paths under /v1, /v2, /inference and /cohere; the RL
routes (/update_weights, /init_weight_transfer_engine, /pause, ...) and the rest answer anyone who
can reach the port. With a key set (RLFT_SERVE_KEY in the server's environment, never on its
command line where `ps` shows it) this middleware asks for `Authorization: Bearer <key>` on every
path but /health, so a load balancer can probe it. It also answers GET /rlft/info: what the
trainer checks before it loads weights (the model's architecture, sizes and the transfer backend,
written by `rlft serve` into RLFT_SERVE_INFO).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

KEY_ENV = "RLFT_SERVE_KEY"
INFO_ENV = "RLFT_SERVE_INFO"
OPEN_PATHS = ("/health",)


def key_matches(authorization: str | None, expected_hash: bytes) -> bool:
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(hashlib.sha256(token.encode()).digest(), expected_hash)


class RouteGuard:
    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV, "")
        self.key_hash = hashlib.sha256(key.encode()).digest() if key else None
        self.info = json.loads(os.environ.get(INFO_ENV, "{}"))

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if self.key_hash is not None and path not in OPEN_PATHS \
                and not key_matches(Headers(scope=scope).get("authorization"), self.key_hash):
            return await JSONResponse({"error": "Unauthorized: this rlft server needs its API key "
                                                "(Authorization: Bearer <key>)"}, status_code=401)(scope, receive, send)
        if path == "/rlft/info":
            return await JSONResponse(self.info)(scope, receive, send)
        return await self.app(scope, receive, send)
