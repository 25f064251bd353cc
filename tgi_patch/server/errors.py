"""The server's errors, each with TGI's `error_type` and HTTP status; every error response is
`{"error", "error_type"}` (`app.py` turns these into responses)."""

from __future__ import annotations


class ServingError(Exception):
    """An error with TGI's `error_type` and HTTP status: 422 validation, 424 generation, 429 overloaded,
    500 incomplete_generation (the request ended without a final token, e.g. cancelled at shutdown)."""

    status = 500
    error_type = "incomplete_generation"


class ValidationError(ServingError):
    status, error_type = 422, "validation"

    def __init__(self, message: str):
        super().__init__(message if message.startswith("Input validation error") else
                         f"Input validation error: {message}")


class GenerationError(ServingError):
    status, error_type = 424, "generation"


class OverloadedError(ServingError):
    status, error_type = 429, "overloaded"


class IncompleteGenerationError(ServingError):
    pass


class ClientDisconnected(IncompleteGenerationError):
    """Nobody reads this answer (status 499, as nginx logs it): only the metrics see it."""

    status = 499
