"""Talking to an OpenAI-compatible chat endpoint (`POST {base_url}/chat/completions`: `vllm serve`,
llama.cpp's server, a hosted API) through one `httpx.Client` per endpoint: the HTTP client the
rollout-server client (`rollout/servers/client.py`) uses too. Its connections are kept open and
reused between requests.

Failures fall in three kinds, because each needs a different answer:
- transient (connection refused or reset, a time limit, HTTP 408/429/5xx): retried with
  exponential back-off, then the sample is unverifiable (None, counted);
- this request only (HTTP 400/413/422: e.g. a conversation longer than the judge's context, or a
  reply that is not a chat completion): not retried, the sample is unverifiable;
- the endpoint is set up wrong (HTTP 401/403/404: a key, a URL or a model name): every request
  would fail the same way, so `EndpointError` stops the run with the fix.
"""

from __future__ import annotations

import ipaddress
import json
import ssl
import time
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from rlft.errors import RlftError
from rlft.rewards.calls import call_all

if TYPE_CHECKING:
    import httpx

SHOWN_BODY = 300  # characters of an error body quoted in messages: enough for a server's reason


class EndpointError(RlftError):
    """The endpoint refuses every request the same way (wrong URL, model or key)."""


class TransientError(Exception):
    """Worth retrying; `retry_after` is the server's Retry-After in seconds, if it sent one."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class RequestFailed(Exception):
    """This request cannot succeed as sent; retrying it would only repeat the answer."""


@dataclass
class Reply:
    """One request's end: the reply's text, or why there is none; the attempts it took."""

    text: str | None
    error: str | None = None
    attempts: int = 1


def chat_url(base_url: str) -> str:
    """The chat-completions URL of a base URL; a bare `http://host:port` gets the usual `/v1`.

    >>> chat_url("http://127.0.0.1:8000"), chat_url("https://api.example.com/v1/")
    ('http://127.0.0.1:8000/v1/chat/completions', 'https://api.example.com/v1/chat/completions')
    """
    parts = urllib.parse.urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"args.base_url {base_url!r} is not an http(s) URL; write e.g. http://127.0.0.1:8000/v1 "
                         "(a local `vllm serve`) or the API's base URL")
    path = parts.path.rstrip("/") or "/v1"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path + "/chat/completions", "", ""))


class Endpoint:
    """A chat model behind `url`: at most `max_concurrency` requests in flight, each attempt
    limited to `timeout_s`, transient failures retried `max_retries` times after waiting
    `backoff_s`, 2 x `backoff_s`, 4 x ... seconds."""

    def __init__(self, url: str, model: str, *, timeout_s: float, max_retries: int, backoff_s: float,
                 max_concurrency: int, api_key: str | None = None, sampling: dict[str, Any] | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        import httpx  # lazy: importing rlft.rewards registers every reward; only a judge in use pays for httpx

        self.url, self.model, self.timeout_s = url, model, timeout_s
        self.max_retries, self.backoff_s, self.max_concurrency = max_retries, backoff_s, max_concurrency
        self.api_key, self.sampling, self.sleep = api_key, dict(sampling or {}), sleep
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"  # httpx.Headers' repr shows it as [secure]
        host = urllib.parse.urlsplit(url).hostname or ""
        self._http = httpx.Client(
            headers=headers,
            # connect, each read and write, and waiting for a pooled connection: each up to timeout_s
            timeout=httpx.Timeout(timeout_s),
            # call_all keeps at most max_concurrency requests in flight; a request it abandoned (a
            # trickling reply) must not hold a connection a new one waits for, so only idle ones are capped
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=max_concurrency),
            # the system's certificate authorities (SSL_CERT_FILE / SSL_CERT_DIR honoured), as Python's own
            verify=ssl.create_default_context(),
            # http(s)_proxy / no_proxy apply, except that a judge on this machine is reached directly
            trust_env=not _is_loopback(host),
            follow_redirects=False,  # a redirected POST is refused as it is (RequestFailed), never resent
        )

    @property
    def longest_request_s(self) -> float:
        """The most one request may take: every attempt to its time limit, with every back-off."""
        return (self.max_retries + 1) * self.timeout_s + sum(self._delay(k, None) for k in range(self.max_retries))

    def ask_all(self, conversations: list[list[dict[str, str]]]) -> list[Reply]:
        """One reply per conversation, `max_concurrency` at a time. An `EndpointError` (or a bug)
        in any request is raised; every other failure is that conversation's Reply.error."""
        budget = self.longest_request_s + 1.0  # the attempts' own limits end them first; this catches a trickle
        outcomes = call_all([lambda c=c: self.ask(c) for c in conversations], self.max_concurrency, budget)
        replies = []
        for out in outcomes:
            if out.error is not None:
                raise out.error
            replies.append(Reply(None, f"no reply within {budget:g}s") if out.timed_out else out.value)
        return replies

    def ask(self, messages: list[dict[str, str]]) -> Reply:
        """One conversation, retried on transient failures."""
        for attempt in range(self.max_retries + 1):
            try:
                return Reply(self._post(messages), attempts=attempt + 1)
            except RequestFailed as exc:
                return Reply(None, str(exc), attempt + 1)
            except TransientError as exc:
                if attempt == self.max_retries:
                    return Reply(None, f"{exc} (after {attempt + 1} attempt{'s' if attempt else ''})", attempt + 1)
                self.sleep(self._delay(attempt, exc.retry_after))
        raise AssertionError("unreachable")

    def _delay(self, retry: int, retry_after: float | None) -> float:
        """Exponential back-off; a shorter Retry-After from the server shortens it, a longer one is
        cut to it (one sample's time is bounded: see `longest_request_s`)."""
        delay = self.backoff_s * 2 ** retry
        return min(delay, retry_after) if retry_after is not None else delay

    def close(self) -> None:
        """Close the kept-open connections (the endpoint cannot be asked again)."""
        self._http.close()

    def _post(self, messages: list[dict[str, str]]) -> str:
        import httpx  # lazy: see __init__ (already loaded by then)

        body = json.dumps({"model": self.model, "messages": messages, **self.sampling}).encode()
        try:
            response = self._http.post(self.url, content=body)
        except httpx.TimeoutException:  # connecting, sending, or a silence while reading, past timeout_s
            raise TransientError(f"no reply from {self.url} within {self.timeout_s:g}s (args.timeout_s)") from None
        except httpx.TransportError as exc:  # refused, reset, a broken reply, a proxy's failure
            raise TransientError(_describe(exc, self.url)) from None
        except httpx.HTTPError as exc:  # a body that does not decode as its Content-Encoding says
            raise RequestFailed(f"{self.url}: {type(exc).__name__}: {exc}") from None
        if not 200 <= response.status_code < 300:
            raise _http_error(response, self.url, self.model)
        return _reply_text(response.content)


def _http_error(response: httpx.Response, url: str, model: str) -> Exception:
    code = response.status_code
    text = response.content.decode("utf-8", "replace")[:SHOWN_BODY]
    said = f"HTTP {code} from {url}" + (f": {text}" if text else "")
    if code in (408, 429) or code >= 500:
        return TransientError(said, _retry_after(response.headers.get("Retry-After")))
    if code == 404:
        return EndpointError(f"{said}\nFix: check args.base_url (an OpenAI-compatible server serves "
                             f"<base_url>/chat/completions; `vllm serve` uses http://HOST:PORT/v1) and args.model "
                             f"({model!r}: the name the server serves, listed by GET <base_url>/models)")
    if code in (401, 403):
        return EndpointError(f"{said}\nFix: set args.api_key_env to the name of the environment variable that "
                             "holds the endpoint's API key")
    return RequestFailed(said)


def _reply_text(raw: bytes) -> str:
    """choices[0].message.content of a chat completion; RequestFailed when the body is not one."""
    try:
        content = json.loads(raw)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise RequestFailed(f"the reply is not a chat completion: {raw[:SHOWN_BODY]!r}") from None
    if not isinstance(content, str):
        raise RequestFailed(f"the reply's message has no text content: {raw[:SHOWN_BODY]!r}")
    return content


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:  # an HTTP date: rare for APIs, and our own schedule then applies
        return None


def _describe(exc: BaseException, url: str) -> str:
    """A transport failure in a line; a refused connection (httpx's ConnectError, raised from the
    socket's ConnectionRefusedError) says so plainly."""
    cause: BaseException | None = exc
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, ConnectionRefusedError):
            return f"connection refused by {url} (is the server running?)"
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return f"{url}: {type(exc).__name__}: {exc}"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
