"""OpenAI-shaped error responses `{"error": {message, type, param, code}}` and the handlers that produce them."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("warmfleet.api")

# status → OpenAI error type
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the API reports to the client as-is; raise it anywhere below a route."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status, headers=headers)


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """First pydantic error as a 400 naming the offending field (FastAPI would say 422)."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = _most_specific(errors)
    # union members name their branch in the location ("list[constrained-int]"): not a field, leave it out
    loc = [str(p) for p in first.get("loc", ()) if p not in _NOT_FIELDS and not (isinstance(p, str) and "[" in p)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return bad_request(f"request body is not valid JSON: {first.get('msg', '')}", code="invalid_json")
    if first.get("type") == "missing":
        return bad_request(f"missing required parameter: {param}", param=param, code="missing_required_parameter")
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    if param is None:  # a whole-body check (a model validator): its message names the field itself
        return bad_request(f"invalid request: {msg}", code="invalid_value")
    return bad_request(f"invalid value for {param}: {msg}", param=param, code="invalid_value")


_NOT_FIELDS = ("body", "str", "int", "float", "bool", "dict", "list", "constrained-int")  # FastAPI's root, union tags


def _most_specific(errors: list) -> dict:
    """For a value matching no member of a union, pydantic reports one error per member, a type mismatch for
    most; the one that is not a mere type mismatch says what is wrong (`[10**20]` as a prompt: "less than
    2147483648", not "should be a valid string")."""
    for e in errors:
        if not str(e.get("type", "")).endswith("_type"):
            return e
    return errors[0]


def install(app: FastAPI) -> None:
    """Register handlers so every failure leaves as OpenAI-shaped JSON."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _request_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(ValidationError)
    async def _validation(request: Request, exc: ValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        code = "not_found" if exc.status_code == 404 else None
        return error_response(APIError(exc.status_code, message, code=code))

    @app.exception_handler(Exception)
    async def _last_resort(request: Request, exc: Exception) -> JSONResponse:
        # NOTE: reaching this is a bug; it exists so that the client still gets JSON, not a dropped connection.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}", code="internal_error"))
