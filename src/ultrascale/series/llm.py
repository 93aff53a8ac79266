"""Any OpenAI-compatible chat endpoint (OpenAI, vLLM, llama.cpp, Ollama, ...) through the `openai` SDK.

- Structured output first: `response_format` carries the episode's JSON schema.
  A server that refuses it (400/422) is asked again without it, once, and the
  JSON is then extracted from the text (a bare object, a ```json fence, or the
  first object inside prose).
- Rate limits (429), timeouts, dropped connections and 5xx answers are retried
  with exponential backoff (`retry_wait`, doubled each time; the server's
  Retry-After instead when it sends one; never more than `max_wait`),
  `retries` times; then EndpointError.
  The SDK's own retries are off, so the budget is exactly this one.
- Every call reports its time and token usage.

EndpointError is a ConfigError: the command prints one line and exits 2.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from ultrascale.errors import ConfigError
from ultrascale.series.episode import EpisodeError
from ultrascale.series.schema import EPISODE_SCHEMA


class EndpointError(ConfigError):
    """The endpoint cannot be used (unreachable, refuses the key, keeps rate-limiting)."""


@dataclass
class Reply:
    text: str
    seconds: float
    prompt_tokens: int | None
    completion_tokens: int | None
    structured: bool  # the server was sent the schema as response_format
    retries: int

    def usage(self) -> str:
        if self.prompt_tokens is None and self.completion_tokens is None:
            return "tokens not reported"
        return f"{self.prompt_tokens or 0:,} prompt + {self.completion_tokens or 0:,} completion tokens"


class ChatModel:
    def __init__(self, model: str, base_url: str | None = None, api_key: str | None = None, retries: int = 4,
                 retry_wait: float = 2.0, max_wait: float = 60.0, timeout: float = 600.0, on_wait=None):
        try:
            import openai
        except ImportError as e:
            raise ConfigError("the generator needs the openai SDK: pip install 'ultrascale[series]'") from e
        if not api_key:
            raise ConfigError("no API key: set OPENAI_API_KEY (any non-empty value for a local server)")
        self.openai = openai
        self.model, self.base_url = model, base_url
        self.retries, self.retry_wait, self.max_wait = retries, retry_wait, max_wait
        self.on_wait = on_wait  # called as on_wait(seconds, reason) before each retry
        self.structured = True
        # A host that never answers costs connect seconds per attempt, not the whole request timeout.
        limit = openai.Timeout(timeout, connect=min(10.0, timeout))
        self.client = openai.OpenAI(api_key=api_key, base_url=base_url, max_retries=0, timeout=limit)

    def where(self) -> str:
        return f"{self.model} at {self.base_url or 'api.openai.com'}"

    def complete(self, messages: list[dict]) -> Reply:
        """One chat completion; retried as the module says."""
        o = self.openai
        retries, start = 0, time.perf_counter()
        while True:
            kwargs = {"model": self.model, "messages": messages}
            if self.structured:
                kwargs["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": "episode", "schema": EPISODE_SCHEMA, "strict": False}}
            try:
                resp = self.client.chat.completions.create(**kwargs)
            except (o.BadRequestError, o.UnprocessableEntityError) as e:
                if self.structured:
                    self.structured = False  # the server does not do schemas: ask for text
                    continue
                raise EndpointError(f"{self.where()} rejected the request ({_status(e)})") from e
            except (o.AuthenticationError, o.PermissionDeniedError) as e:
                raise EndpointError(f"{self.where()} refused the API key ({_status(e)}); check OPENAI_API_KEY") from e
            except o.NotFoundError as e:
                raise EndpointError(f"{self.where()}: not found ({_status(e)}); check --model and --base-url") from e
            except (o.RateLimitError, o.APITimeoutError, o.APIConnectionError, o.InternalServerError) as e:
                reason = _reason(e)
                if retries >= self.retries:
                    raise EndpointError(f"{self.where()}: {reason}, still after {retries} "
                                        f"retr{'y' if retries == 1 else 'ies'} "
                                        f"({time.perf_counter() - start:.1f} s); try again later or check "
                                        f"--base-url") from e
                after = _retry_after(e)
                wait = min(self.max_wait, after if after is not None else self.retry_wait * 2 ** retries)
                if self.on_wait:
                    self.on_wait(wait, reason)
                time.sleep(wait)
                retries += 1
                continue
            except o.APIError as e:
                raise EndpointError(f"{self.where()}: {type(e).__name__} ({_status(e)})") from e
            break
        choice = resp.choices[0] if getattr(resp, "choices", None) else None
        text = (choice.message.content if choice and choice.message else None) or ""
        usage = getattr(resp, "usage", None)
        return Reply(text, time.perf_counter() - start, getattr(usage, "prompt_tokens", None),
                     getattr(usage, "completion_tokens", None), "response_format" in kwargs, retries)


def _status(e) -> str:
    code = getattr(e, "status_code", None)
    msg = str(getattr(e, "message", "") or e).splitlines()[0][:200]
    return f"HTTP {code}: {msg}" if code else msg


def _reason(e) -> str:
    return {"RateLimitError": "rate limited (HTTP 429)", "APITimeoutError": "the request timed out",
            "APIConnectionError": "cannot connect"}.get(
        type(e).__name__, f"server error (HTTP {getattr(e, 'status_code', '5xx')})")


def _retry_after(e) -> float | None:
    response = getattr(e, "response", None)
    value = response.headers.get("retry-after") if response is not None else None
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


_FENCE = re.compile(r"```[ \t]*([A-Za-z]*)[ \t]*\n(.*?)```", re.S)


def extract_json(text: str):
    """The JSON object in a reply: the whole text, a fenced block, or the first object in prose."""
    s = text.strip()
    if not s:
        raise EpisodeError("the reply is empty; send the episode as one JSON object")
    try:
        return json.loads(s)
    except json.JSONDecodeError as e:
        first_error = e
    for lang, body in sorted(_FENCE.findall(s), key=lambda m: -len(m[1])):
        try:
            return json.loads(body)
        except json.JSONDecodeError:
            continue
    decoder = json.JSONDecoder()
    for m in re.finditer(r"\{", s):
        try:
            obj, _ = decoder.raw_decode(s, m.start())
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and len(obj) > 1:
            return obj
    raise EpisodeError(f"the reply is not valid JSON (line {first_error.lineno}, column {first_error.colno}: "
                       f"{first_error.msg}); send one JSON object")
