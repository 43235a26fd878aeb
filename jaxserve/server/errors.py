"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}, for every failure.

Routes raise APIError; Werkzeug's HTTP errors (404, 405, 413, 415, malformed requests) and any
unexpected exception get the same body shape, so a client never sees an HTML page.
"""
from __future__ import annotations

import logging

from flask import Flask, jsonify
from werkzeug.exceptions import HTTPException

log = logging.getLogger(__name__)

ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def error_response(error: APIError):
    response = jsonify(error.body())
    response.status_code = error.status
    if error.status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"
    return response


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(e: APIError):
        return error_response(e)

    @app.errorhandler(HTTPException)
    def _http_error(e: HTTPException):
        message = {
            404: "no such route",
            405: "method not allowed for this route",
            413: f"request body larger than {app.config['MAX_CONTENT_LENGTH']} bytes",
            415: "Content-Type must be application/json",
        }.get(e.code, e.description)
        response = error_response(APIError(e.code or 500, message))
        if e.code == 405 and e.valid_methods:
            response.headers["Allow"] = ", ".join(e.valid_methods)
        return response

    @app.errorhandler(Exception)
    def _unexpected(e: Exception):
        log.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(e).__name__}"))
