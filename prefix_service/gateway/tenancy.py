"""Tenancy: whose a namespace is. A door turns the caller (:class:`Tenant`), the namespace it names and
its ``cache_salt`` into the one scope string every room below keys by, so nothing below knows owners.
Spec: docs/SECURITY.md#tenancy-in-the-prefix-service (namespaces with auth on and off, shared namespaces, the admin)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine_service.api.errors import InvalidArgument
from engine_service.api.owners import check_owner

Scope = Callable[[str], bool]  # which scopes a caller's Stats / Clear cover


@dataclass(frozen=True)
class Tenant:
    """A caller: its ``owner`` id, ``authenticated`` when it came from a credential (auth on)."""

    owner: str
    authenticated: bool = False


@dataclass(frozen=True)
class Tenancy:
    """The operator's declarations: ``shared`` namespaces (every caller's), the ``admin`` owner
    (global Stats / Clear; "" none). See the module docstring."""

    shared: frozenset[str] = frozenset()
    admin: str = ""

    def __post_init__(self) -> None:
        if self.admin:
            check_owner(self.admin, "admin_owner")

    @classmethod
    def of(cls, shared: Iterable[str] = (), admin: str = "") -> Tenancy:
        return cls(frozenset(shared), admin)

    def scope(self, tenant: Tenant, namespace: str, cache_salt: str = "") -> str:
        """The scope ``tenant``'s ``namespace`` (under ``cache_salt``) is keyed by."""
        for name, value in (("namespace", namespace), ("cache_salt", cache_salt)):
            if not isinstance(value, str):
                raise InvalidArgument(f"{name} must be a string, got {type(value).__name__}")
        bound = tenant.authenticated and namespace not in self.shared
        # injective: an unbound unsalted name not starting with "[" is itself (as before tenancy, so its
        # snapshot files stay valid); any other is the JSON list [owner or "", namespace, salt]
        if not bound and not cache_salt and not namespace.startswith("["):
            return namespace
        return json.dumps([tenant.owner if bound else "", namespace, cache_salt])

    def is_admin(self, tenant: Tenant) -> bool:
        return not tenant.authenticated or (bool(self.admin) and tenant.owner == self.admin)

    def visible(self, tenant: Tenant) -> Scope | None:
        """The scopes ``tenant``'s Stats and Clear cover; None: every scope (the admin)."""
        if self.is_admin(tenant):
            return None
        owner = tenant.owner
        return lambda scope: owner_of_scope(scope) == owner


def owner_of_scope(scope: str) -> str:
    """The owner a scope is bound to; "" for a shared or unbound one."""
    if not scope.startswith("["):
        return ""
    try:
        parts = json.loads(scope)
    except ValueError:
        return ""
    return parts[0] if isinstance(parts, list) and len(parts) == 3 and isinstance(parts[0], str) else ""
