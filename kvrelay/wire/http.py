"""What every kvrelay HTTP front shares: OpenAI error bodies, reading and checking a
request body (size, JSON, text), ids, usage and SSE framing. The proxy speaks only this
(and ``kvrelay.wire.sse``); the request models live in ``kvrelay.wire.openai``."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request

M = TypeVar("M", bound=BaseModel)
log = logging.getLogger(__name__)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers  # e.g. Retry-After of a 429
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message, "type": self.type, "param": self.param,
                "code": self.code,
            }
        }


def bad_request(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Every error of ``app`` as an OpenAI error body: ours, the framework's (404 for an
    unknown path, 405), and anything unexpected (500)."""

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = ApiError(exc.status_code, str(exc.detail), code=str(exc.status_code))
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)


def parse_body(raw: bytes, model: type[M]) -> M:
    """JSON bytes -> a request model, or an ApiError naming the field."""
    return validate(load_json(raw), model)


def load_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a 400. Refused: malformed or too deeply
    nested JSON, NaN and Infinity (not JSON numbers; nothing downstream can carry
    them), strings with a lone surrogate (not text: no tokenizer or encoder takes them)."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except _NotANumber as exc:
        raise bad_request(None, f"the request body is not valid JSON: {exc} is not a JSON "
                          "number (use null or a finite number)") from exc
    except (ValueError, RecursionError) as exc:  # ValueError: also an int of >4300 digits
        raise bad_request(None, f"the request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise bad_request(None, "the request body must be a JSON object")
    _check_strings(data)
    return data


# Unknown field names already warned about: once per name and process, so that a router
# that adds its own fields to every request (vllm-router: no_stop_trim,
# return_hidden_states, ...) does not log a line per request. Bounded: names past the
# cap are logged at DEBUG only, as a client could send a new name each time.
_WARNED: set[str] = set()
WARNED_NAMES_MAX = 256


def validate(data: dict[str, Any], model: type[M]) -> M:
    """A parsed JSON object -> a request model, or an ApiError naming the field.

    Fields the model lacks: a known unsupported sampling field is a 400 naming it; any
    other is dropped (newer clients keep working), with a warning in the log the first
    time a name is seen, as vLLM warns."""
    refused: dict[str, tuple[Callable[[Any], bool], str]] = getattr(model, "REFUSED", {})
    unknown = []
    for key, value in data.items():
        if key in model.model_fields:
            continue
        rule = refused.get(key)
        if rule is not None:
            if not rule[0](value):
                raise bad_request(key, f"{key}: {rule[1]}")
        elif key not in getattr(model, "HARMLESS", ()):
            unknown.append(key)
    if unknown:
        new = sorted(k for k in unknown if k not in _WARNED)
        if new and len(_WARNED) < WARNED_NAMES_MAX:
            _WARNED.update(new[:WARNED_NAMES_MAX - len(_WARNED)])
            log.warning("the request's fields %s are not known here: ignored (said once "
                        "per name)", new)
        else:
            log.debug("the request's fields %s are not known here: ignored", sorted(unknown))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = param_from_loc(err["loc"])
        missing = err["type"] == "missing"
        msg = f"{param} is required" if missing else f"{param}: {err['msg']}"
        raise bad_request(param, msg) from exc


class _NotANumber(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise _NotANumber(name)


def _check_strings(data: dict[str, Any]) -> None:
    """400 naming the first string (or key) that is not valid Unicode text. Iterative:
    json.loads already bounded the depth, this walk must not hit the recursion limit."""
    stack: list[tuple[Any, list[int | str]]] = [(data, [])]
    while stack:
        value, loc = stack.pop()
        if isinstance(value, str):
            _check_text(value, loc)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, loc)
                stack.append((v, [*loc, k]))
        elif isinstance(value, list):
            stack.extend((v, [*loc, i]) for i, v in enumerate(value))


def _check_text(s: str, loc: list[int | str]) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as exc:
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        raise bad_request(path or None, f"{path or 'the request body'} holds a lone surrogate "
                          f"({s[exc.start]!r} at offset {exc.start}): not valid text") from exc


MAX_BODY_BYTES = 16 * 1024 * 1024


async def read_body(request: Request) -> bytes:
    """The request body, refusing more than MAX_BODY_BYTES before reading it all."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody reads the answer; without this it was logged as an unhandled error
        # and answered 500 (the soak's abort storms: 24 on D in 30 minutes).
        raise ApiError(499, "the client disconnected before its request body was read",
                       code="client_disconnected") from None
    return b"".join(chunks)


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none)$|[\[\-]")


def param_from_loc(loc: Sequence[int | str]) -> str:
    """('messages', 0, 'content', 'str') -> 'messages[0].content'. Union tags dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif _TYPE_TAG.search(part):
            break
        else:
            out += f".{part}" if out else part
    return out or "body"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(data: dict[str, Any] | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def error_event(message: str, status: int = 502) -> dict[str, Any]:
    """An OpenAI error body (a 5xx is a server error, else the request's)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}
