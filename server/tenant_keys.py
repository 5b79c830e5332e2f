"""Client API keys and their cache salts, one recipe for router, endpoint picker and replica (`--api-keys-file`).

A key's salt is the keys file's value if it gives one, else HMAC-SHA256(secret, key)[:32]. A request's salt is the
tenant's, or `TENANT/CLIENT` when the client names a `cache_salt` of its own: it partitions further inside the tenant,
never across tenants. A client salt that is already inside the tenant (the tenant's salt, or `TENANT/...`, as a router
or picker rewrites it) is kept as it is, so a body salted once keeps its salt through a second door: the router, the
picker and a replica with the same keys file hash the same request to the same prefix-cache entries (contract 1).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Iterable, Optional

DEFAULT_SALT_SECRET = "warmfleet-cache-salt-v1"
SALT_SECRET_ENV = "WARMFLEET_SALT_SECRET"  # --salt-secret's env form, the same on routers, pickers and replicas
CLIENT_KEY_ENV = "WARMFLEET_CLIENT_API_KEY"  # a replica's one more client key, salted as a router's --api-key keys


def derive_salt(key: str, secret: str = DEFAULT_SALT_SECRET) -> str:
    return hmac.new(secret.encode(), key.encode(), hashlib.sha256).hexdigest()[:32]


def read_keys_file(path: str) -> dict[str, Optional[str]]:
    """`{"key": "salt" | null, ...}` from `path`; ValueError names what is wrong (a salt may not hold `/`, which
    separates a tenant's salt from its clients' own: `a` + client `b` would otherwise be the tenant salted `a/b`)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the API keys file: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) and k.strip() and (v is None or isinstance(v, str))
                                             for k, v in data.items()):
        raise ValueError(f"{path}: expected a JSON object mapping API keys (not empty) to salts (or null)")
    if any(v and "/" in v for v in data.values()):
        raise ValueError(f"{path}: a salt may not contain '/'")
    return data


def key_salts(keys: dict[str, Optional[str]], secret: Optional[str] = None) -> dict[str, str]:
    """Each key's tenant salt: the given one, else derived with `secret` (default DEFAULT_SALT_SECRET)."""
    return {k: (s or derive_salt(k, secret or DEFAULT_SALT_SECRET)) for k, s in keys.items()}


def tenant_salt(salt: str, client_salt: Optional[str]) -> str:
    """The salt a request of the tenant whose salt is `salt` runs under, whatever `client_salt` it names."""
    if not client_salt or client_salt == salt or client_salt.startswith(salt + "/"):
        return client_salt or salt
    return f"{salt}/{client_salt}"


def bearer_key(keys: Iterable[str], authorization: Optional[str]) -> Optional[str]:
    """The key of `keys` that `Authorization: Bearer KEY` names, else None (compared in constant time with each)."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    given = token.strip().encode()
    found = None
    for key in keys:
        if hmac.compare_digest(key.encode(), given):
            found = key
    return found
