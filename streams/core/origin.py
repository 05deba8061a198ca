"""Marks no writer can forge without the deployment's secret: the processor's on its own
`persist-messages` events, the operator's on the events its commands publish there (`memfilter
history import`, `memfilter forget`), and the agent runner's on the replies it streams.

The processor saves a request's rows in Redis itself and also publishes them on
`persist-messages`, so that the log holds every write. A worker must skip those events (they
are saved already), and `memfilter history rebuild` must apply them with the processor's
rights: the first save of a thread sets its owner, which no other writer may do. Other
services write the same topic, so a header alone would let any of them pass an event off as
the processor's: skipped live but applied by a rebuild, the two histories would differ.

So the processor signs each event it publishes: header `memfilter.origin: processor`, and
`memfilter.signature`, the HMAC-SHA256 of the value under the deployment's secret
(MEMFILTER_SECRET). Live and in a rebuild alike, an event is the processor's exactly when its
signature verifies; one that claims the origin without it is refused in both (`origin`).

The operator's commands write history through the log too, with rights no service has: an
import sets the owner of the threads it brings in, an erasure removes a thread for good. Their
events carry `memfilter.origin: operator` and a signature under a key derived from the
secret for that purpose alone (`operator_headers`), so neither mark can be made from the other,
and a live worker applies them (it skips only the processor's own, saved already).

A request that waited for its turn is decided when the worker wakes it (`memfilter.runtime.turns`):
a record on `chat-requests` that carries the waiting request, and `memfilter.wake`, the HMAC
of the thread and the value (`wake_headers`), so that no publisher can wake a request early,
or wake one of another thread.

A reply streamed on `reply-streams` is relayed by the gateway to the browser of the request's
resource. So that no other writer of that topic can put words in a reply (or end it), each
attempt's id is a nonce and the HMAC of the nonce, the request, the thread and the resource
(`attempt`): the gateway relays a chunk only when its attempt verifies for the request,
thread and resource it names (`is_attempt`).
"""

from __future__ import annotations

import hashlib
import hmac

ORIGIN_HEADER = "memfilter.origin"
ORIGIN = (ORIGIN_HEADER, b"processor")
OPERATOR = (ORIGIN_HEADER, b"operator")
SIGNATURE = "memfilter.signature"


def headers(value: bytes, secret: bytes) -> tuple[tuple[str, bytes], ...]:
    """The headers that mark `value` as the processor's."""
    return (ORIGIN, (SIGNATURE, hmac.digest(secret, value, hashlib.sha256).hex().encode()))


def is_processors(value: bytes | None, headers, secret: bytes) -> bool:
    """Does the record carry the processor's mark, with a signature that verifies?"""
    if ORIGIN not in headers or value is None:
        return False
    signature = next((v for k, v in headers if k == SIGNATURE), b"")
    return hmac.compare_digest(signature, hmac.digest(secret, value, hashlib.sha256).hex().encode())


def claims_origin(headers) -> bool:
    """Does the record carry a `memfilter.origin` header, of any value?"""
    return any(k == ORIGIN_HEADER for k, _ in headers)


def _operator_key(secret: bytes) -> bytes:
    return hmac.digest(secret, b"memfilter operator events", hashlib.sha256)


def operator_headers(value: bytes, secret: bytes) -> tuple[tuple[str, bytes], ...]:
    """The headers that mark `value` as an operator command's (import, erasure)."""
    return (OPERATOR, (SIGNATURE, hmac.digest(_operator_key(secret), value, hashlib.sha256).hex().encode()))


def is_operators(value: bytes | None, headers, secret: bytes) -> bool:
    """Does the record carry the operator's mark, with a signature that verifies?"""
    if OPERATOR not in headers or value is None or not secret:
        return False
    signature = next((v for k, v in headers if k == SIGNATURE), b"")
    return hmac.compare_digest(signature, hmac.digest(_operator_key(secret), value, hashlib.sha256).hex().encode())


WAKE_HEADER = "memfilter.wake"


def wake_headers(key: bytes, value: bytes, secret: bytes) -> tuple[tuple[str, bytes], ...]:
    """The header that marks a `chat-requests` record as the worker's wake of a request that
    waited for its turn (`memfilter.runtime.turns`), bound to its thread (the key)."""
    return ((WAKE_HEADER, _wake_mac(key, value, secret)),)


def is_wake(key: bytes | None, value: bytes | None, headers, secret: bytes) -> bool | None:
    """True for the worker's wake, whose signature verifies; False for a record that claims to
    be one without it; None for a record that does not claim to be one."""
    mac = next((v for k, v in headers if k == WAKE_HEADER), None)
    if mac is None:
        return None
    return key is not None and value is not None and hmac.compare_digest(mac, _wake_mac(key, value, secret))


def _wake_mac(key: bytes, value: bytes, secret: bytes) -> bytes:
    return hmac.digest(secret, b"wake\n" + key + b"\n" + value, hashlib.sha256).hex().encode()


def attempt(secret: bytes, request_id: str, thread: str, resource: str, nonce: str) -> str:
    """The id of one attempt at a reply, bound to its request, thread and resource."""
    mac = hmac.digest(secret, f"attempt\n{request_id}\n{thread}\n{resource}\n{nonce}".encode(), hashlib.sha256).hex()[:32]
    return f"{nonce}.{mac}"


def is_attempt(value: str, secret: bytes, request_id: str, thread: str, resource: str) -> bool:
    """Was this attempt id made under the secret for that request, thread and resource?"""
    nonce, dot, _ = value.partition(".")
    return bool(dot) and hmac.compare_digest(value, attempt(secret, request_id, thread, resource, nonce))
