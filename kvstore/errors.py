"""Every error kvsieve raises on purpose: one family under `KVSieveError`.

The gRPC layer maps each class to one status code in one table
(kvstore/rpc/status.py); an exception outside this family is a bug and
reaches a client as INTERNAL, never as "invalid input". The DSL's errors
(engine_adapter/dsl/errors.py) derive from these classes too.

This module imports nothing but the standard library, so every layer may use it.

    KVSieveError
    ├── InvalidInputError (also ValueError)     bad request argument; nothing written
    │   └── (DSL) ProgramError
    ├── NotFoundError (also KeyError)           unknown lease, arena or block
    ├── ChecksumError                           stored bytes fail their checksum
    ├── StoreFullError                          no room even after eviction
    │   ├── LimitExceededError                  a server limit or tenant quota
    │   └── ArenaLimitError                     a shared-memory arena limit
    ├── TierFullError                           one tier cannot take a block
    ├── StorageUnavailableError                 a tier's storage failed; retry
    │   └── RemoteUnavailableError              the remote tier is down or refused
    ├── DamagedStoreError                       a data directory's files are damaged
    ├── DataDirBusyError                        another process holds the data directory
    ├── ListenError                             a server's address is in use or not listenable
    ├── FsckCannotRunError                      fsck could not check anything
    ├── UnauthenticatedError                    no valid bearer token
    ├── PermissionDeniedError                   the token does not grant the namespace
    ├── RpcFailedError                          a call failed with a non-domain status
    └── (DSL) ProgramRuntimeError
"""

from __future__ import annotations

from typing import Protocol


class KVSieveError(Exception):
    """Base class of every kvsieve error."""


class InvalidInputError(KVSieveError, ValueError):
    """A request argument is malformed; the message names the field and the allowed values.

    Raised before anything is written, so stored data is never touched by bad input.
    """


class NotFoundError(KVSieveError, KeyError):
    """A named object (lease, arena, block) does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message.
        return str(self.args[0]) if self.args else ""


class ChecksumError(KVSieveError):
    """Stored bytes do not match their checksum or their header; the data is never returned."""


class StoreFullError(KVSieveError):
    """No room is left in a tier even after evicting every unpinned block."""


class LimitExceededError(StoreFullError):
    """A server limit or a tenant quota would be exceeded (RESOURCE_EXHAUSTED)."""


class ArenaLimitError(StoreFullError):
    """A shared-memory arena would exceed a limit, or its memory is not there."""


class TierFullError(KVSieveError):
    """The tier cannot take a block until something is deleted."""


class StorageUnavailableError(KVSieveError):
    """A tier's storage failed (I/O error, file deleted under the store): retry elsewhere or later.

    Nothing of the failed call was kept. The gRPC layer maps it to UNAVAILABLE.
    """


class RemoteUnavailableError(StorageUnavailableError):
    """The Redis/Valkey server cannot be reached, timed out, failed, or the breaker is open.

    Every failure of the remote tier is raised as this class (the cause chained),
    never as a raw client-library exception.
    """


class DamagedStoreError(KVSieveError):
    """A data directory's files are damaged (truncated, empty, not LMDB); the store refuses to open.

    The message names the file and, given `data_dir`, says to run `kvsieve fsck`;
    `reason` is the message without that advice.
    """

    def __init__(self, reason: str, data_dir: object = None) -> None:
        hint = "" if data_dir is None else f"; run `kvsieve fsck --data-dir {data_dir}` to check it"
        super().__init__(reason + hint)
        self.reason = reason


class DataDirBusyError(KVSieveError):
    """Another process holds the data directory in a conflicting mode."""


class ListenError(KVSieveError):
    """A server cannot listen on its address: another process holds it, or it is not this machine's."""


class FsckCannotRunError(KVSieveError):
    """fsck could not check anything (no store at the path, the check process failed)."""


class UnauthenticatedError(KVSieveError):
    """No valid bearer token."""


class PermissionDeniedError(KVSieveError):
    """The caller's token does not grant the namespace, lease or arena it asked for."""


class _StatusCode(Protocol):
    """What `RpcFailedError` needs of a `grpc.StatusCode` (so this module imports no grpc)."""

    @property
    def name(self) -> str: ...


class RpcFailedError(KVSieveError):
    """A call failed with a status that maps to no domain error (UNAVAILABLE, DEADLINE_EXCEEDED,
    INTERNAL). `code` is the `grpc.StatusCode`."""

    def __init__(self, code: _StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
