"""Bearer tokens of the serving process, read from the environment (secrets never live in config files).

- ``GEMFLOW_SERVING_TOKEN``: when set, the inference routes (and model metadata / stats) require
  ``Authorization: Bearer <token>``; health probes and ``/metrics`` stay open for the kubelet and Prometheus.
- ``GEMFLOW_SERVING_ADMIN_TOKEN``: required by KServe's model-repository extension (load/unload), which is off
  unless ``admin.repository_api`` is set; enabling it without a token is refused at start-up.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass

TOKEN_ENV, ADMIN_TOKEN_ENV = "GEMFLOW_SERVING_TOKEN", "GEMFLOW_SERVING_ADMIN_TOKEN"


class AuthError(ValueError):
    """The serving process cannot start with this authentication setup."""


@dataclass(frozen=True)
class Tokens:
    inference: str | None  # None: inference routes are open
    admin: str | None  # None: the model-repository extension is off

    @classmethod
    def from_env(cls, repository_api: bool, env: dict[str, str] | None = None) -> Tokens:
        env = os.environ if env is None else env
        inference = env.get(TOKEN_ENV) or None
        admin = env.get(ADMIN_TOKEN_ENV) or None
        if repository_api and admin is None:
            raise AuthError(f"admin.repository_api=true needs a token in ${ADMIN_TOKEN_ENV}")
        return cls(inference, admin if repository_api else None)


def bearer_ok(headers: dict[bytes, bytes], token: str | None) -> bool:
    """True when ``token`` is None (open) or the request carries ``Authorization: Bearer <token>``."""
    if token is None:
        return True
    given = headers.get(b"authorization", b"")
    scheme, _, value = given.partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(value.strip(), token.encode())
