"""A stand-in for an OpenAI-compatible judge server (`vllm serve`'s /v1/chat/completions), started
on 127.0.0.1 by the tests that use it: it grades deterministically by the rubric the tests give,
and a few marker answers make it fail in the ways real servers do.

The rubrics it implements: LENGTH_RUBRIC, "Score: N" with N the answer's length in characters (at
most 10; for training runs, whose answers are a tiny model's), and RUBRIC: an answer to grade
("## Answer to grade") gets "Score: N", N the number of times it says "good" (at most 10); a pair
("## Answer A" / "## Answer B") gets the answer saying "good" more often (a pair where either
says "garbage" gets no verdict). Marker answers under RUBRIC (the first word):
  word W   -> the reply is just "W."                 json N  -> a fenced {"score": N}
  garbage  -> a reply without a score                badjson -> a 200 whose body is not JSON
  flaky    -> HTTP 500 the first time, then a score  busy    -> HTTP 429 (Retry-After: 0) once
  slow     -> waits SLOW_S before answering          nap     -> waits NAP_S (concurrency tests)
A request for a model other than MODEL gets HTTP 404, as vLLM answers an unknown model.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "stub-judge"
RUBRIC = "Count how many times the answer says 'good'; that count (at most 10) is its score."
LENGTH_RUBRIC = "The longer the better: the answer's number of characters (at most 10) is its score."
SLOW_S, NAP_S = 1.5, 0.2


class JudgeStub:
    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []  # each: {"body": ..., "headers": ...}
        self.visits: Counter[str] = Counter()  # requests per answer text (for fail-once markers)
        self.in_flight = self.peak = 0
        self.garbage_after: int | None = None  # every request past this many gets a reply without a score
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep test output clean
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub._lock:
                    stub.requests.append({"body": body, "headers": dict(self.headers)})
                    stub.in_flight += 1
                    stub.peak = max(stub.peak, stub.in_flight)
                    late = stub.garbage_after is not None and len(stub.requests) > stub.garbage_after
                try:
                    if self.path != "/v1/chat/completions" or body.get("model") != MODEL:
                        return self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not "
                                                                      "exist."}})
                    status, reply, headers = stub.answer(body["messages"][-1]["content"], late)
                    if status != 200:
                        return self._send(status, {"error": {"message": reply}}, headers)
                    if reply is None:
                        return self._send(200, b"not json")
                    self._send(200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]})
                finally:
                    with stub._lock:
                        stub.in_flight -= 1

            def _send(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (a timeout test)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def answer(self, content: str, late: bool) -> tuple[int, str | None, dict[str, str]]:
        """(HTTP status, reply text or None for a non-JSON body, extra headers)."""
        if (RUBRIC not in content and LENGTH_RUBRIC not in content) or late:
            return 200, "I would rather not say.", {}
        if LENGTH_RUBRIC in content:
            n = min(len(re.search(r"## Answer to grade\n(.*?)\n\nEnd your reply", content, re.DOTALL).group(1)), 10)
            return 200, f"{n} characters or more.\nScore: {n}", {}
        pair = re.search(r"## Answer A\n(.*?)\n\n## Answer B\n(.*?)\n\n", content, re.DOTALL)
        if pair:
            if "garbage" in pair.group(1) + pair.group(2):
                return 200, "Both have merits.", {}
            a, b = pair.group(1).count("good"), pair.group(2).count("good")
            return 200, "Verdict: " + ("A" if a > b else "B" if b > a else "tie"), {}
        answer = re.search(r"## Answer to grade\n(.*?)\n\n", content, re.DOTALL).group(1)
        marker, _, rest = answer.partition(" ")
        with self._lock:
            self.visits[answer] += 1
            first = self.visits[answer] == 1
        if marker == "word":
            return 200, f"{rest}.", {}
        if marker == "json":
            return 200, f'Some reasoning.\n```json\n{{"score": {rest}}}\n```', {}
        if marker == "garbage":
            return 200, "I would rather not say.", {}
        if marker == "badjson":
            return 200, None, {}
        if marker == "flaky" and first:
            return 500, "internal error", {}
        if marker == "busy" and first:
            return 429, "slow down", {"Retry-After": "0"}
        if marker in ("slow", "nap"):
            time.sleep(SLOW_S if marker == "slow" else NAP_S)
        return 200, f"It says good {answer.count('good')} times.\nScore: {min(answer.count('good'), 10)}", {}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def closed_port_url() -> str:
    """A base URL on 127.0.0.1 where nothing listens (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"
