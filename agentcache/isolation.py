"""Who may reuse what: caller scopes and the cache salts that keep them apart.

A tenant owns its anchor pools (statistical corrections learned across its sessions) and its
exact prefix blocks. A session owns its materializations (the sources of the next workflow
edges) and, per agent, the lineage of approximate blocks those calls cached. Salts are digests
of an unambiguous encoding of every part (JSON of a tagged list), so no choice of names, not
even separators inside them or `None` against a string spelling it, makes two callers collide.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

__all__ = ["Scope", "engine_session", "lineage_salt", "tenant_salt"]


@dataclass(frozen=True)
class Scope:
    """A session of a tenant: the unit that owns materializations and agents' latest outputs."""

    tenant: str | None = None  # None: the runtime's default tenant
    session: str | None = None  # None: the tenant's default session


def _digest(*parts: str | None) -> str:
    encoded = json.dumps(list(parts), ensure_ascii=True, separators=(",", ":"))
    return hashlib.blake2b(encoded.encode(), digest_size=16).hexdigest()


def lineage_salt(runtime_id: str, scope: Scope, agent: str) -> str:
    """Salt of the approximate KV a call caches: only this agent's later calls in the same runtime,
    tenant and session find it."""
    return "lineage:" + _digest("lineage", runtime_id, scope.tenant, scope.session, agent)


def tenant_salt(tenant: str | None) -> str | None:
    """Namespace of a tenant's exact prefix blocks; None (the engine-wide namespace) for the default
    tenant. Exact KV depends on the tokens alone, so runtimes that share an engine and a tenant name
    share these blocks."""
    return None if tenant is None else "tenant:" + _digest("tenant", tenant)


def engine_session(scope: Scope) -> str | None:
    """The session as an engine's eviction policy sees it: sessions of different tenants apart."""
    if scope.tenant is None:
        return scope.session
    return json.dumps([scope.tenant, scope.session])
