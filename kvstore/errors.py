"""Domain errors of kvsieve. The gRPC layer maps each to one status code."""


class KVSieveError(Exception):
    """Base class of every kvsieve error."""


class InvalidInputError(KVSieveError, ValueError):
    """A request argument is malformed; the message names the field and the allowed values.

    Raised before anything is written, so stored data is never touched by bad input.
    """


class ChecksumError(KVSieveError):
    """Stored bytes do not match their checksum or their header; the data is never returned."""


class StoreFullError(KVSieveError):
    """No room is left in a tier even after evicting every unpinned block."""


class StorageUnavailableError(KVSieveError):
    """A tier's storage failed (I/O error, file deleted under the store): retry elsewhere or later.

    Nothing of the failed call was kept. The gRPC layer maps it to UNAVAILABLE.
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


class NotFoundError(KVSieveError, KeyError):
    """A named object (lease, block) does not exist."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the plain message.
        return str(self.args[0]) if self.args else ""
