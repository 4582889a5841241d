"""What every OpenAI request body and error shares: the strict pydantic base of the bodies and
their parts, and the error answered in OpenAI's shape."""

from __future__ import annotations

from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, model_validator

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 500: "InternalServerError", 503: "ServiceUnavailableError"}


class ErrorInfo(BaseModel):
    message: str
    type: str  # "BadRequestError", "NotFoundError", ... (ERROR_TYPES)
    param: Optional[str]  # the request field at fault, as the user spelled it
    code: int  # the HTTP status


class ErrorResponse(BaseModel):
    """Every error's body, in OpenAI's shape (/openapi.json documents it)."""

    error: ErrorInfo


class ApiError(Exception):
    """An error answered as an `ErrorResponse` with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        error_type = ERROR_TYPES.get(self.status, "BadRequestError" if self.status < 500 else "InternalServerError")
        return ErrorResponse(error=ErrorInfo(message=self.message, type=error_type, param=self.param,
                                             code=self.status)).model_dump()


class Body(BaseModel):
    # strict: no coercion ("2" is not 2, 2.0 is not 2, 1 is not true), as the API always answered;
    # allow_inf_nan: Python's JSON parser reads NaN and Infinity, which no sampling field takes.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # OpenAI clients send null for a field they were not given: the default applies.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data
