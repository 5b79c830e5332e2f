"""Tenants: API keys, each key's cache salt, and per-client concurrency limits; no I/O beyond reading the key file.

A key's salt is the mapping file's value if it gives one, else HMAC-SHA256(secret, key) (server/tenant_keys.py, shared
with the replicas' `--api-keys-file`). Every router process with the same keys and secret derives the same salt, so
routers agree, and a tenant cannot name another tenant's salt without that tenant's key.
"""

from __future__ import annotations

from typing import Callable, Optional

from ...tenant_keys import DEFAULT_SALT_SECRET, bearer_key, derive_salt, key_salts, read_keys_file, tenant_salt
from .errors import Refusal

__all__ = ["DEFAULT_SALT_SECRET", "derive_salt", "Tenants", "ConcurrencyLimiter", "admit_client"]


class Tenants:
    """Known API keys → cache salt; an empty set means the router is open (no key required)."""

    def __init__(self, keys: dict[str, Optional[str]], secret: str = DEFAULT_SALT_SECRET):
        self._salts = key_salts(keys, secret)

    @classmethod
    def from_flags(cls, api_keys: list[str], keys_file: Optional[str], secret: Optional[str]) -> "Tenants":
        """`--api-key` values plus a JSON file `{"key": "salt" | null, ...}` (server/tenant_keys.py)."""
        keys: dict[str, Optional[str]] = {k: None for k in api_keys if k}
        if keys_file:
            keys.update(read_keys_file(keys_file))
        return cls(keys, secret or DEFAULT_SALT_SECRET)

    @property
    def enabled(self) -> bool:
        return bool(self._salts)

    def authenticate(self, authorization: Optional[str]) -> Optional[str]:
        """The key from `Authorization: Bearer KEY` if it is known, else None (constant time per key)."""
        return bearer_key(self._salts, authorization)

    def salt_for(self, key: str, client_salt: Optional[str]) -> str:
        """The tenant's salt; a client-given salt partitions further inside the tenant, never across tenants (the
        same recipe as a replica's `--api-keys-file`, so both doors give the same salt)."""
        return tenant_salt(self._salts[key], client_salt)


class ConcurrencyLimiter:
    """At most `limit` open requests per client (0 = unlimited) across every router; `try_acquire` / `release`.

    The limit is fleet-wide: with peer routers (`--peers`), `remote(client)` gives the client's open
    requests on the other routers (their last report, peers.PeerLoad), and a request is admitted only
    while this router's count plus theirs stays under the limit. Not `limit / routers` per router: a
    plain L4 balancer pins a client's keep-alive connection to one router, which would then allow that
    client only a fraction of its limit. Overshoot is bounded by what peers admitted since their last
    report (one polling interval).
    """

    def __init__(self, limit: int, remote: Optional[Callable[[str], int]] = None):
        if limit < 0:
            raise ValueError("--max-concurrent-per-client must be >= 0")
        self.limit = limit
        self.remote = remote
        self.open: dict[str, int] = {}

    def try_acquire(self, client: str) -> bool:
        n = self.open.get(client, 0)
        if self.limit and n + (self.remote(client) if self.remote is not None else 0) >= self.limit:
            return False
        self.open[client] = n + 1
        return True

    def release(self, client: str) -> None:
        n = self.open.get(client, 0) - 1
        if n > 0:
            self.open[client] = n
        else:
            self.open.pop(client, None)


def admit_client(tenants: Tenants, limiter: ConcurrencyLimiter, host: str, auth: Optional[str],
                 body: Optional[dict]) -> str | Refusal:
    """What every front door does before routing: authenticate (and salt `body` with the tenant's `cache_salt`),
    then take a per-client slot. Returns the client's key (release it with `limiter.release(key)` when the answer's
    last byte has gone), or the 401 / 429 to answer."""
    client = host
    if tenants.enabled:
        key = tenants.authenticate(auth)
        if key is None:
            return Refusal(401, "missing or unknown API key", "authentication_error")
        client = "key:" + key
        if body is not None:
            salt = body.get("cache_salt")
            body["cache_salt"] = tenants.salt_for(key, salt if isinstance(salt, str) else None)
    if not limiter.try_acquire(client):
        return Refusal(429, f"more than {limiter.limit} concurrent requests from this client", "rate_limit_error")
    return client
