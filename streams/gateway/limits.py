"""Fair limits per caller: no resource takes a gateway's turns from the others.

Each resource (the caller, as `memfilter.gateway.identity` names it) has, on each gateway:
- a rate: a token bucket of MEMFILTER_GATEWAY_CALLER_BURST requests, refilled at
  MEMFILTER_GATEWAY_CALLER_RATE a second: a turn, a resume, a stop each take one;
- a number of requests held open at once (turns waiting or streaming, resumes following):
  MEMFILTER_GATEWAY_CALLER_IN_FLIGHT.

Past either, the request is answered 429 `rate-limited` with `Retry-After` (the seconds until
a token is back, or 1 for a held request to end), before anything is published. The gateway's
own bound on requests held at once (MEMFILTER_GATEWAY_MAX_IN_FLIGHT, 503 `busy`) stays: these
keep one caller from reaching it. Limits are a gateway's own, not the deployment's: behind a
load balancer of N gateways a caller may have up to N times as much.

Pure: the clock is given. Once many callers are remembered (KEPT), those that are as a new
caller would be (a full bucket, nothing held) are dropped: memory follows the callers active now.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

KEPT = 10_000  # callers remembered before the idle ones are dropped


@dataclass(frozen=True)
class Refused:
    """A request past its caller's share: the seconds until it may be sent again, and whether
    it was the requests held open (`held`) or the rate that stopped it."""

    seconds: float
    held: bool

    def retry_after(self) -> str:
        """`Retry-After`'s value: whole seconds, at least one."""
        return str(max(1, math.ceil(self.seconds)))


@dataclass
class _Caller:
    tokens: float
    at: float  # when `tokens` was counted
    held: int = 0


class Fairness:
    def __init__(self, rate: float, burst: int, in_flight: int, clock: Callable[[], float]):
        self.rate, self.burst, self.in_flight, self.clock = rate, burst, in_flight, clock
        self.callers: dict[str, _Caller] = {}

    def admit(self, resource: str, holds: bool) -> Refused | None:
        """Take a request of `resource` (one that stays open, if `holds`: `release` it after):
        None if it may go on, else why not and when it may be sent again."""
        now = self.clock()
        caller = self.callers.get(resource)
        if caller is None:
            if len(self.callers) >= KEPT:
                self._forget_idle(now)
            caller = self.callers[resource] = _Caller(float(self.burst), now)
        caller.tokens = min(float(self.burst), caller.tokens + (now - caller.at) * self.rate)
        caller.at = now
        if holds and caller.held >= self.in_flight:
            return Refused(1.0, held=True)
        if caller.tokens < 1.0:
            return Refused((1.0 - caller.tokens) / self.rate, held=False)
        caller.tokens -= 1.0
        caller.held += holds
        return None

    def release(self, resource: str) -> None:
        """A held request of `resource` has ended."""
        caller = self.callers.get(resource)
        if caller is not None and caller.held > 0:
            caller.held -= 1

    def _forget_idle(self, now: float) -> None:
        for resource in [r for r, c in self.callers.items() if c.held == 0 and c.tokens + (now - c.at) * self.rate >= self.burst]:
            del self.callers[resource]
