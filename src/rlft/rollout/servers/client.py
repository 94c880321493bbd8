"""Talking to one `rlft serve` server: its routes, and the checks a run makes before loading weights.

Every call sends the key (`Authorization: Bearer`, from the environment variable
`rollout.server.api_key_env` names) and turns what can go wrong into one `ServerError` naming the
server, what failed and the fix. The weight-update calls make this a `VLLMWeightSyncClient`
(vLLM's trainer-side transfer engines drive a round through them).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from rlft.errors import ServerError
from rlft.models.loading import load_tokenizer

SERVE_HINT = "start it with `rlft serve MODEL --port PORT` (see the scaling guide)"


class ServerLost(ServerError):
    """The server is gone or broken (no connection, a timeout, a 5xx): another server may take its
    work. Any other `ServerError` (a refused request) would fail on every server alike."""


def server_key(env_name: str) -> str | None:
    return os.environ.get(env_name) or None


class ServerClient:
    def __init__(self, url: str, key: str | None, timeout_s: float, connect_timeout_s: float = 10.0):
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers,
                                 timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))
        self.outstanding = 0  # requests in flight (the engine balances groups by it)
        self.alive = True
        self.failure = ""  # why it was taken out of the rotation

    # -- transport --------------------------------------------------------------------------
    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        import httpx

        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TimeoutException:
            raise ServerLost(f"rollout server {self.url} did not answer {method} {path} within "
                             f"{self.http.timeout.read:.0f} s (rollout.server.timeout_s)") from None
        except httpx.HTTPError as exc:
            raise ServerLost(f"rollout server {self.url} is not reachable ({type(exc).__name__}: {exc}); "
                             f"{SERVE_HINT}, or fix rollout.servers") from None
        if response.status_code == 401:
            raise ServerError(f"rollout server {self.url} refused the API key: set the environment variable the "
                              "run reads (rollout.server.api_key_env, default RLFT_SERVER_API_KEY) to the key the "
                              "server was started with")
        if response.status_code >= 400:
            error = (ServerLost if response.status_code >= 500 else ServerError)(
                f"rollout server {self.url} answered {method} {path} with {response.status_code}: {response.text[:500]}")
            error.status = response.status_code
            raise error
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:  # some routes answer plain text (vLLM's /v1/load_lora_adapter)
            return response.text

    def close(self) -> None:
        self.http.close()

    # -- what it serves -----------------------------------------------------------------------
    def info(self) -> dict[str, Any]:
        self.request("GET", "/health")
        try:
            return self.request("GET", "/rlft/info")
        except ServerError as exc:
            if getattr(exc, "status", None) == 404:
                raise ServerError(f"{self.url} is a vLLM server not started by rlft serve (it has no /rlft/info, "
                                  f"so no key guard on its weight routes and no rlft transfer backend); {SERVE_HINT}"
                                  ) from None
            raise

    def max_model_len(self) -> int:
        return int(self.request("GET", "/v1/models")["data"][0]["max_model_len"])

    def generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self.request("POST", "/inference/v1/generate", json=payload)

    # -- weights (vLLM's VLLMWeightSyncClient, plus versions and adapters) ---------------------
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.request("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.request("POST", "/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self.request("POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.request("POST", "/finish_weight_update",
                     json={"weight_version": weight_version} if weight_version is not None else None)

    def update_weight_version(self, version: str) -> None:
        self.request("POST", "/update_weight_version", json={"new_version": version})

    def weight_version(self) -> str:
        return str(self.request("GET", "/weight_info")["weight_version"])

    def reset_prefix_cache(self) -> None:
        self.request("POST", "/reset_prefix_cache")

    def load_adapter(self, name: str, path: str) -> None:
        self.request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    def unload_adapter(self, name: str) -> None:
        self.request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})


# -- the checks before weights load ------------------------------------------------------------

PROBE_CHAT = [{"role": "system", "content": "You check tokenizers."},
              {"role": "user", "content": "What is 12 + 30? Answer in <answer></answer> tags."}]


def model_facts(model_config: Any) -> dict[str, Any]:
    """What must agree between the policy and a server's model (also what `rlft serve` reports)."""
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return {"architectures": list(getattr(model_config, "architectures", None) or []),
            "model_type": getattr(model_config, "model_type", None),
            "vocab_size": getattr(text, "vocab_size", None),
            "hidden_size": getattr(text, "hidden_size", None),
            "num_hidden_layers": getattr(text, "num_hidden_layers", None)}


def tokenizer_facts(tokenizer: Any) -> dict[str, Any]:
    """What must agree between the trainer's tokenizer and a server's model folder: the vocabulary's
    size, each special token's id, and the chat template (the ids a probe conversation renders to).
    Both sides compute them with rlft's tokenizer loading (`rlft serve` on the server's folder):
    the server samples from token ids and rlft decodes, so vLLM's own tokenizer class never decides."""
    template = getattr(tokenizer, "chat_template", None)
    probe = None
    if template:
        rendered = tokenizer.apply_chat_template(PROBE_CHAT, add_generation_prompt=True, tokenize=True)
        probe = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    return {"vocab_size": len(tokenizer),
            "special_tokens": {t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens},
            "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
            "probe_ids": probe}


def check_server(client: ServerClient, model_config: Any, tokenizer: Any, lora_rank: int | None) -> dict[str, Any]:
    """One error listing every way `client`'s server cannot serve this policy (before any weight
    loads): another architecture or size, another tokenizer (vocabulary, special tokens, chat
    template), no LoRA slot for an adapter. Returns the server's info."""
    info = client.info()
    wrong = []
    served, served_tok = info.get("model", {}), info.get("tokenizer", {})
    for key, ours in model_facts(model_config).items():
        if served.get(key) != ours:
            wrong.append(f"{key}: the server's model has {served.get(key)!r}, the policy {ours!r}")
    tok = tokenizer_facts(tokenizer)
    if served_tok.get("vocab_size") != tok["vocab_size"]:
        wrong.append(f"tokenizer vocabulary: {served_tok.get('vocab_size')} tokens on the server, {tok['vocab_size']} "
                     "in the policy's tokenizer")
    if served_tok.get("special_tokens") != tok["special_tokens"]:
        theirs = served_tok.get("special_tokens") or {}
        differ = sorted(set(theirs.items()) ^ set(tok["special_tokens"].items()))
        wrong.append(f"special tokens: {', '.join(f'{t!r}={i}' for t, i in differ[:6])} differ")
    if served_tok.get("chat_template_sha256") != tok["chat_template_sha256"] or \
            served_tok.get("probe_ids") != tok["probe_ids"]:
        wrong.append("chat template: the server's model folder has another chat template (a conversation renders "
                     "to other token ids)")
    if lora_rank is not None and (info.get("max_lora_rank") or 0) < lora_rank:
        wrong.append(f"LoRA: the policy trains a rank-{lora_rank} adapter and the server "
                     + ("takes no adapters" if not info.get("max_lora_rank") else
                        f"takes ranks up to {info['max_lora_rank']}")
                     + f" (start it with `rlft serve ... --lora-rank {lora_rank}`)")
    if wrong:
        raise ServerError(f"rollout server {client.url} serves {served.get('path', 'another model')!r}, which does "
                          "not match the policy:\n  " + "\n  ".join(wrong)
                          + "\nstart the server with the policy's model folder (rlft serve MODEL_OR_RUN)")
    return info


def preflight(urls: list[str], settings: Any, model: Any, lora_rank: int | None) -> None:
    """`check_server` on every server from the model's folder (its config and tokenizer, no
    weights): a run with a server down, keyed otherwise or serving another model stops here."""
    from transformers import AutoConfig

    model_config = AutoConfig.from_pretrained(model.path)
    tokenizer = load_tokenizer(model)
    for url in urls:
        client = ServerClient(url, server_key(settings.api_key_env), settings.timeout_s)
        try:
            check_server(client, model_config, tokenizer, lora_rank)
        finally:
            client.close()
