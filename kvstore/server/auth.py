"""Bearer-token authorisation: which namespaces a caller may use."""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping

from kvstore.errors import PermissionDeniedError, UnauthenticatedError

ADMIN = "*"


class Authorizer:
    """Maps bearer tokens to the namespaces they grant.

    A token granted "*" is an admin: it may use every namespace and sees the
    whole store's figures in `Stats`; any other token sees only its own
    namespaces. With no tokens configured every caller is an admin (the server
    then only listens on loopback unless told otherwise; see ServerConfig).
    """

    def __init__(self, tokens: Mapping[str, Iterable[str]]) -> None:
        self._grants = {token: frozenset(namespaces) for token, namespaces in tokens.items()}

    @property
    def enabled(self) -> bool:
        """Whether tokens are required."""
        return bool(self._grants)

    def caller(self, metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
        """The caller's token, checked; None when auth is off. Raises UnauthenticatedError."""
        if not self._grants:
            return None
        header = next((str(v) for k, v in metadata if k == "authorization"), "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() == "bearer":
            for known in self._grants:
                # constant-time comparison: no timing oracle on the token
                if hmac.compare_digest(known.encode(), token.encode()):
                    return known
        raise UnauthenticatedError("missing or invalid bearer token (metadata 'authorization: Bearer ...')")

    def check(self, token: str | None, namespace: str) -> None:
        """Raise PermissionDeniedError unless `token` grants `namespace`."""
        if token is None:
            return
        grants = self._grants[token]
        if ADMIN not in grants and namespace not in grants:
            raise PermissionDeniedError(f"token does not grant namespace {namespace!r}")

    def scope(self, token: str | None) -> frozenset[str] | None:
        """The namespaces whose figures `token` may see; None means all (an admin)."""
        if token is None or ADMIN in self._grants[token]:
            return None
        return self._grants[token]
