"""The one table from kvsieve errors to gRPC status codes, and back.

The servicer turns an exception into a status with `status_for` (it aborts the
call with `Status.code` and `Status.details`); the client turns a status back
into the error class with `error_for`. Only classes of the `KVSieveError` family
are in the table: anything else is a bug, becomes INTERNAL and is logged with
its traceback, so a stray `ValueError` never reaches a client as "invalid input".
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import grpc

from kvstore.errors import (
    ChecksumError,
    DamagedStoreError,
    DataDirBusyError,
    InvalidInputError,
    KVSieveError,
    NotFoundError,
    PermissionDeniedError,
    RpcFailedError,
    StorageUnavailableError,
    StoreFullError,
    TierFullError,
    UnauthenticatedError,
)

log = logging.getLogger("kvsieve.server")

# Error class -> status code, most specific first (subclasses are matched by isinstance).
STATUS_TABLE: tuple[tuple[type[KVSieveError], grpc.StatusCode], ...] = (
    (InvalidInputError, grpc.StatusCode.INVALID_ARGUMENT),
    (StoreFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TierFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StorageUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (ChecksumError, grpc.StatusCode.DATA_LOSS),
    (UnauthenticatedError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (DamagedStoreError, grpc.StatusCode.FAILED_PRECONDITION),
    (DataDirBusyError, grpc.StatusCode.FAILED_PRECONDITION),
)

# Status code -> the error a client raises. UNAVAILABLE is left out on purpose: it also
# means "server gone", which the client reports as RpcFailedError like any transport failure.
_CLIENT_ERRORS: dict[grpc.StatusCode, type[KVSieveError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidInputError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: StoreFullError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.DATA_LOSS: ChecksumError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


class Status(NamedTuple):
    """What a call ends with: its status code and the message the client sees."""

    code: grpc.StatusCode
    details: str


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status code of `exc`: its row of the table, INTERNAL for anything else."""
    for cls, code in STATUS_TABLE:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def status_of(exc: BaseException, service: str = "kvsieve") -> Status:
    """`status_for` plus the details to send. An unknown exception is logged with its traceback."""
    code = status_for(exc)
    if code != grpc.StatusCode.INTERNAL:
        return Status(code, str(exc))
    log.error("internal error in a %s call: %s: %s", service, type(exc).__name__, exc, exc_info=exc)
    return Status(code, f"internal error: {type(exc).__name__}: {exc}")


def error_for(code: grpc.StatusCode, details: str) -> KVSieveError:
    """Inverse of `status_for` on the client: the domain error for a status code.

    A code with no domain error (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, ...) gives
    `RpcFailedError`, which keeps the code.
    """
    cls = _CLIENT_ERRORS.get(code)
    return RpcFailedError(code, details) if cls is None else cls(details)
