"""Who sends a request to the gateway: the resource it acts for, from an authenticated identity.

A request's `resourceId` decides which threads it may read and write; a body can name any, so
it never comes from the body. Two ways, by `MEMFILTER_GATEWAY_AUTH`:
- `jwt`: `Authorization: Bearer <token>`, a JWT verified with PyJWT: signed, not expired (give
  or take MEMFILTER_GATEWAY_LEEWAY_S), carrying `exp` and the claim that names the resource
  (MEMFILTER_GATEWAY_RESOURCE_CLAIM, `sub` by default), and the issuer and an audience when
  MEMFILTER_GATEWAY_ISSUER and MEMFILTER_GATEWAY_AUDIENCE are set. The key is either fixed
  (MEMFILTER_GATEWAY_JWT_KEY: an HS256 secret, or a PEM public key for RS256, ES256 or EdDSA)
  or the identity provider's (MEMFILTER_GATEWAY_JWKS_URL: `KeySet`). A token is verified only
  with the algorithm of its key: `alg: none`, or an HS256 token "signed" with a public key
  (the classic confusion), is refused.
- `header`: the header MEMFILTER_GATEWAY_RESOURCE_HEADER, as a proxy in front set it after
  its own authentication. Anyone who reaches the gateway can set it, so this mode is for a
  gateway behind such a proxy or on loopback only (`memfilter gateway` says so at start).

Either way the resource is an id (`memfilter.schemas.wire.Id`), or the caller is refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import jwt

from memfilter.schemas.wire import id_problem
from memfilter.settings import Gateway

log = logging.getLogger("memfilter")
ASYMMETRIC = ["RS256", "RS384", "RS512", "ES256", "ES384", "EdDSA"]
# A token of a key id the set lacks fetches the set again at most this often: a flood of
# invented key ids costs the identity provider one request every JWKS_MIN_REFETCH_S, no more,
# and a key rotated in without being published first is taken within as long.
JWKS_MIN_REFETCH_S = 5.0
JWKS_TIMEOUT_S = 5.0


class Unauthenticated(Exception):
    """No identity, or one that does not verify: answered 401 with this message."""


Identify = Callable[[Mapping[str, str]], Awaitable[str]]


class KeySet:
    """The identity provider's signing keys (its JWKS), by key id: fetched on first use, again
    every `refresh_s`, and again on a token of a key id it lacks (a key rotated in), at most
    every `min_refetch_s`. Only asymmetric keys are taken (RSA, EC, OKP): a symmetric key in a
    public document would let anyone sign. While the provider does not answer, the keys held
    go on verifying."""

    def __init__(self, url: str, refresh_s: float, fetched: Callable[[], None] = lambda: None, min_refetch_s: float = JWKS_MIN_REFETCH_S):
        self.url, self.refresh_s, self.min_refetch_s = url, refresh_s, min_refetch_s
        self.keys: dict[str | None, jwt.PyJWK] = {}  # by key id (None: a key without one)
        self.fetched_at = -float("inf")  # monotonic, of the last try
        self._fetched = fetched  # told of each fetch (a metric)
        self._fetching = asyncio.Lock()

    async def key(self, kid: str | None) -> jwt.PyJWK:
        now = time.monotonic()
        due = now - self.fetched_at >= self.refresh_s or (kid not in self.keys and now - self.fetched_at >= self.min_refetch_s)
        if due:
            async with self._fetching:
                if self.fetched_at <= now:  # not fetched by another request meanwhile
                    await self.fetch()
        if kid is None and len(self.keys) == 1:
            return next(iter(self.keys.values()))
        if kid not in self.keys:
            raise Unauthenticated(f"the bearer token's key id {kid!r} is not one of the identity provider's signing keys ({self.url})")
        return self.keys[kid]

    async def fetch(self) -> None:
        self.fetched_at = time.monotonic()
        self._fetched()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=JWKS_TIMEOUT_S)) as http, http.get(self.url) as r:
                r.raise_for_status()
                document = await r.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            log.warning("memfilter gateway: the identity provider's keys at %s could not be fetched (%r); the %d held go on", self.url, e, len(self.keys))
            return
        keys: dict[str | None, jwt.PyJWK] = {}
        for data in document.get("keys", []) if isinstance(document, dict) else []:
            if not isinstance(data, dict) or data.get("kty") not in ("RSA", "EC", "OKP") or data.get("use", "sig") != "sig":
                continue
            try:
                keys[data.get("kid")] = jwt.PyJWK(data)
            except jwt.PyJWKError as e:
                log.warning("memfilter gateway: a key of %s is not usable (%s); left out", self.url, e)
        self.keys = keys


def resource_of(settings: Gateway, jwks_fetched: Callable[[], None] = lambda: None) -> Identify:
    """The function that reads a request's headers and returns its resource, or raises
    `Unauthenticated`; `jwks_fetched` is told of each fetch of the provider's keys."""
    if settings.auth == "header":
        name = settings.resource_header

        async def from_header(headers: Mapping[str, str]) -> str:
            value = headers.get(name, "").strip()
            if not value:
                raise Unauthenticated(f"no {name} header: the proxy in front of the gateway sets it to the caller's resource id")
            if problem := id_problem(value):
                raise Unauthenticated(f"the {name} header {problem}: it names the caller's resource id")
            return value

        return from_header

    key_set = KeySet(settings.jwks_url, settings.jwks_refresh_s, jwks_fetched) if settings.jwks_url else None
    fixed = settings.jwt_key
    fixed_algorithms = ASYMMETRIC if fixed.lstrip().startswith("-----BEGIN") else ["HS256"]
    claim = settings.resource_claim

    async def from_token(headers: Mapping[str, str]) -> str:
        scheme, _, token = headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated(f"no bearer token: send Authorization: Bearer <JWT> whose `{claim}` is the caller's resource id")
        key: Any = fixed
        algorithms = fixed_algorithms
        if key_set is not None:
            try:
                header = jwt.get_unverified_header(token)
            except jwt.InvalidTokenError as e:
                raise Unauthenticated(f"the bearer token does not verify: {e}") from None
            signing = await key_set.key(header.get("kid"))
            if header.get("alg") != signing.algorithm_name:
                raise Unauthenticated(f"the bearer token is signed with {header.get('alg')!r}; its key takes {signing.algorithm_name} alone")
            key, algorithms = signing.key, [signing.algorithm_name]
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=algorithms,
                audience=settings.audience or None,
                issuer=settings.issuer or None,
                leeway=settings.leeway_s,
                options={"require": ["exp", claim], "verify_aud": bool(settings.audience)},
            )
        except jwt.ExpiredSignatureError:
            raise Unauthenticated("the bearer token has expired") from None
        except jwt.InvalidAudienceError:
            raise Unauthenticated(f"the bearer token is not for this gateway: its `aud` is not {settings.audience!r} (MEMFILTER_GATEWAY_AUDIENCE)") from None
        except jwt.InvalidIssuerError:
            raise Unauthenticated(f"the bearer token was not issued by {settings.issuer!r} (MEMFILTER_GATEWAY_ISSUER)") from None
        except jwt.InvalidTokenError as e:
            raise Unauthenticated(f"the bearer token does not verify: {e}") from None
        resource = claims[claim]
        if problem := id_problem(resource):
            raise Unauthenticated(f"the bearer token's `{claim}` {problem}: it names the caller's resource id")
        return resource

    return from_token
