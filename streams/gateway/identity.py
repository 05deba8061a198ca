"""Who sends a request to the gateway: the resource it acts for, from an authenticated identity.

A request's `resourceId` decides which threads it may read and write; a body can name any, so
it never comes from the body. Two ways, by `MEMFILTER_GATEWAY_AUTH`:
- `jwt`: `Authorization: Bearer <token>`, verified with PyJWT against MEMFILTER_GATEWAY_JWT_KEY
  (an HS256 secret, or a PEM public key for RS256, ES256 or EdDSA); it must be signed, not
  expired, and carry `exp` and `sub`; the resource is `sub`.
- `header`: the header MEMFILTER_GATEWAY_RESOURCE_HEADER, as a proxy in front set it after
  its own authentication. Anyone who reaches the gateway can set it, so this mode is for a
  gateway behind such a proxy or on loopback only (`memfilter gateway` says so at start).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jwt

from memfilter.schemas.wire import id_problem
from memfilter.settings import Gateway

ASYMMETRIC = ["RS256", "RS384", "RS512", "ES256", "ES384", "EdDSA"]


class Unauthenticated(Exception):
    """No identity, or one that does not verify: answered 401 with this message."""


def resource_of(settings: Gateway) -> Callable[[Mapping[str, str]], str]:
    """The function that reads a request's headers and returns its resource, or raises `Unauthenticated`."""
    if settings.auth == "header":
        name = settings.resource_header

        def from_header(headers: Mapping[str, str]) -> str:
            value = headers.get(name, "").strip()
            if not value:
                raise Unauthenticated(f"no {name} header: the proxy in front of the gateway sets it to the caller's resource id")
            if problem := id_problem(value):
                raise Unauthenticated(f"the {name} header {problem}: it names the caller's resource id")
            return value

        return from_header

    key = settings.jwt_key
    algorithms = ASYMMETRIC if key.lstrip().startswith("-----BEGIN") else ["HS256"]

    def from_token(headers: Mapping[str, str]) -> str:
        scheme, _, token = headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("no bearer token: send Authorization: Bearer <JWT> whose `sub` is the caller's resource id")
        try:
            claims = jwt.decode(token.strip(), key, algorithms=algorithms, options={"require": ["exp", "sub"]})
        except jwt.ExpiredSignatureError:
            raise Unauthenticated("the bearer token has expired") from None
        except jwt.InvalidTokenError as e:
            raise Unauthenticated(f"the bearer token does not verify: {e}") from None
        sub = claims["sub"]
        if problem := id_problem(sub):
            raise Unauthenticated(f"the bearer token's `sub` {problem}: it names the caller's resource id")
        return sub

    return from_token
