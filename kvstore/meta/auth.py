"""Who may call the metadata service, and what each tenant sees.

With ``meta.auth_file`` set, every call must carry a known credential: a bearer token (gRPC
metadata ``authorization: Bearer <token>``; ``client.token``, ``daemon.token``) or a client
certificate whose common name is listed (mutual TLS). The file names identities and their
role::

    identities:
      tenant-a: {role: tenant, tokens: ["<random token>"]}
      tenant-b: {role: tenant, certs: ["tenant-b"]}        # certificate common names
      node-1:   {role: daemon, tokens: ["<random token>"]}  # the name is the daemon id
      ops:      {role: admin, certs: ["admin"]}

- a **tenant** puts, looks up, gets, pins and removes its own blocks, and ends only its own
  puts and leases;
- a **daemon** registers, heartbeats and drains only under its own name;
- an **admin** reads statistics, drains any daemon and removes blocks of any tenant
  (``KeysRequest.tenant``).

Tenants are isolated by their keys: the index stores a tenant's block key XOR a 128-bit mask
derived from the tenant's name and a service secret (``meta.tenant_secret_file``, made once,
kept across restarts, so the daemons' inventories still mean the same keys). Identical prompts
of two tenants are two blocks, dedup is per tenant, and no tenant can name another's block: the
difference of two masks is unknown without the secret. Clients get their blocks' stored keys in
the locations they are handed, for the data port. Without ``meta.auth_file`` every caller is
trusted, as one tenant.

The daemon that runs in the service's own process (``kvstore serve``) needs no entry in the file:
the process mints it a token of its own (:meth:`Authority.mint`), 256 random bits that are kept
in memory only and travel only on the daemon's channel to its own service, so no other caller
can present them.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore.errors import InvalidArgument, PermissionDenied, Unauthenticated

ROLES = ("tenant", "daemon", "admin")
SECRET_BYTES = 32


@dataclass(frozen=True)
class Identity:
    name: str
    role: str


OPEN = Identity("", "admin")  # no auth file: every caller, one tenant, all rights


class Authority:
    def __init__(self, path: str, secret_path: str = "") -> None:
        import yaml

        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except OSError as e:
            raise InvalidArgument(f"meta.auth_file {path}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise InvalidArgument(f"meta.auth_file {path}: not valid YAML: {e}") from None
        idents = data.get("identities") if isinstance(data, dict) else None
        if not isinstance(idents, dict) or not idents:
            raise InvalidArgument(f"meta.auth_file {path}: expected a mapping 'identities' of name -> role")
        self.tokens: dict[str, Identity] = {}
        self.certs: dict[str, Identity] = {}
        for name, spec in idents.items():
            if not isinstance(spec, dict) or spec.get("role") not in ROLES:
                raise InvalidArgument(f"meta.auth_file: identity {name!r} needs a role in {ROLES}")
            ident = Identity(str(name), spec["role"])
            tokens, certs = spec.get("tokens") or [], spec.get("certs") or []
            if not tokens and not certs:
                raise InvalidArgument(f"meta.auth_file: identity {name!r} has no tokens and no certs")
            for t in tokens:
                if not isinstance(t, str) or len(t) < 16:
                    raise InvalidArgument(
                        f"meta.auth_file: identity {name!r}: tokens must be strings of 16+ characters"
                    )
                if t in self.tokens:
                    raise InvalidArgument(f"meta.auth_file: a token of {name!r} is also {self.tokens[t].name!r}'s")
                self.tokens[t] = ident
            for c in certs:
                self.certs[str(c)] = ident
        self.secret = _secret(secret_path or f"{path}.secret")
        self._masks: dict[str, np.ndarray] = {}

    def identify(self, context) -> Identity:  # noqa: ANN001 - a grpc ServicerContext
        md = dict(context.invocation_metadata() or ())
        auth = md.get("authorization", "")
        if auth:
            token = auth[7:] if auth.startswith("Bearer ") else ""
            ident = self.tokens.get(token)
            if ident is None:
                raise Unauthenticated("unknown bearer token")
            return ident
        ac = context.auth_context() or {}
        for cn in ac.get("x509_common_name", ()):
            ident = self.certs.get(cn.decode(errors="replace"))
            if ident is not None:
                return ident
        raise Unauthenticated("no known credentials: a bearer token or a listed client certificate is required")

    def mint(self, name: str, role: str) -> str:
        """A new token for the identity ``name`` in ``role``, known to this process only (it is
        written nowhere): the credentials of a part of the service's own process. Refused where
        the file gives ``name`` another role."""
        if role not in ROLES:
            raise InvalidArgument(f"unknown role {role!r} (one of {ROLES})")
        for ident in (*self.tokens.values(), *self.certs.values()):
            if ident.name == name and ident.role != role:
                raise InvalidArgument(
                    f"meta.auth_file names {name!r} as a {ident.role}; a {role} of this process cannot have that name"
                )
        token = secrets.token_urlsafe(32)
        self.tokens[token] = Identity(name, role)
        return token

    def mask(self, tenant: str) -> np.ndarray:
        m = self._masks.get(tenant)
        if m is None:
            digest = hashlib.blake2b(tenant.encode(), key=self.secret, digest_size=16).digest()
            m = self._masks[tenant] = np.frombuffer(digest, np.uint8)
        return m

    def keys(self, packed: bytes, tenant: str) -> bytes:
        """``packed`` keys (N x 16) as the index stores them for ``tenant``."""
        if not packed or len(packed) % 16:
            return packed  # the index reports the malformed batch
        a = np.frombuffer(packed, np.uint8).reshape(-1, 16) ^ self.mask(tenant)
        return a.tobytes()


def require(ident: Identity, *roles: str) -> None:
    if ident.role not in roles:
        who = f"{ident.role} {ident.name!r}" if ident.name else ident.role
        raise PermissionDenied(f"{who} may not make this call (it needs: {' or '.join(roles)})")


def _secret(path: str) -> bytes:
    p = Path(path)
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        data = os.urandom(SECRET_BYTES)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    if len(data) != SECRET_BYTES:
        raise InvalidArgument(f"meta.tenant_secret_file {path}: expected {SECRET_BYTES} bytes, got {len(data)}")
    return data


class _Held:
    """Bytes each tenant holds in items (leases or pins) up to a bound, as running totals; items
    that ended elsewhere (expiry, removal) are let go only when a tenant would pass its bound,
    so the common case costs a dictionary update."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.items: dict = {}  # item -> (tenant, bytes)
        self.totals: dict[str, int] = {}

    def fits(self, tenant: str, nbytes: int, alive) -> tuple[bool, int]:  # noqa: ANN001 - item -> bool
        """Whether ``nbytes`` more fit ``tenant``'s bound; ``alive`` tells which of its items
        still hold bytes. Returns (fits, bytes held)."""
        held = self.totals.get(tenant, 0)
        if held + nbytes > self.limit:
            for item in [i for i, (t, _b) in self.items.items() if t == tenant and not alive(i)]:
                self.drop(item)
            held = self.totals.get(tenant, 0)
        return held + nbytes <= self.limit, held

    def add(self, item, tenant: str, nbytes: int) -> None:  # noqa: ANN001
        self.drop(item)
        self.items[item] = (tenant, nbytes)
        self.totals[tenant] = self.totals.get(tenant, 0) + nbytes

    def drop(self, item) -> None:  # noqa: ANN001
        got = self.items.pop(item, None)
        if got is not None:
            self.totals[got[0]] -= got[1]


class Quotas:
    """Per-tenant bytes held in read leases and in pins, bounded by
    ``meta.tenant_max_leased_bytes`` and ``meta.tenant_max_pinned_bytes`` (0: no bound), so that
    one tenant cannot hold the pool's space against eviction."""

    def __init__(self, max_leased: int = 0, max_pinned: int = 0) -> None:
        self.leases = _Held(max_leased)  # lease id -> (tenant, bytes)
        self.pins = _Held(max_pinned)  # stored key -> (tenant, bytes)

    @property
    def max_leased(self) -> int:
        return self.leases.limit

    @property
    def max_pinned(self) -> int:
        return self.pins.limit
