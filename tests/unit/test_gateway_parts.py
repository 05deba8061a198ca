"""The gateway's pure parts: a saved reply as UI message stream chunks, and who a request is from."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import time
from collections import Counter

import jwt
import pytest

from memfilter.core.ui_stream import DONE, chunks, event
from memfilter.gateway.identity import Unauthenticated, resource_of
from memfilter.gateway.shards import owners
from memfilter.settings import Gateway


def stored(*parts: dict) -> dict:
    return {"id": "r1", "role": "assistant", "createdAt": "2026-01-01T00:00:00.000Z", "content": {"format": 2, "parts": list(parts)}}


class TestAReplyAsChunks:
    def test_starts_with_the_stored_id_and_each_step_is_framed(self):
        assert chunks(stored({"type": "step-start"}, {"type": "text", "text": "hi"})) == [
            {"type": "start", "messageId": "r1"},
            {"type": "start-step"},
            {"type": "text-start", "id": "r1-1"},
            {"type": "text-delta", "id": "r1-1", "delta": "hi"},
            {"type": "text-end", "id": "r1-1"},
            {"type": "finish-step"},
            {"type": "finish"},
        ]

    def test_a_pending_client_call_is_its_input_and_an_answered_one_its_output_too(self):
        call = {"type": "tool-invocation", "toolInvocation": {"state": "call", "toolCallId": "c1", "toolName": "weather", "args": {"city": "Oslo"}}}
        done = {"type": "tool-invocation", "toolInvocation": {"state": "result", "toolCallId": "c2", "toolName": "weather", "args": {}, "result": 21}}
        assert chunks(stored(call, done))[1:-1] == [
            {"type": "tool-input-available", "toolCallId": "c1", "toolName": "weather", "input": {"city": "Oslo"}},
            {"type": "tool-input-available", "toolCallId": "c2", "toolName": "weather", "input": {}},
            {"type": "tool-output-available", "toolCallId": "c2", "output": 21},
        ]

    def test_reasoning_and_a_file_come_out_as_their_chunks_and_an_unknown_part_stays_out(self):
        out = chunks(stored({"type": "reasoning", "reasoning": "thinking"}, {"type": "file", "mimeType": "image/png", "data": "data:,x"}, {"type": "mystery"}))
        assert [c["type"] for c in out] == ["start", "reasoning-start", "reasoning-delta", "reasoning-end", "file", "finish"]

    def test_events_are_server_sent_and_the_stream_ends_with_done(self):
        assert event({"type": "finish"}) == b'data: {"type":"finish"}\n\n' and DONE == b"data: [DONE]\n\n"


class TestWhoARequestIsFrom:
    KEY = "k" * 32

    def identify(self, headers: dict[str, str]) -> str:
        return asyncio.run(resource_of(Gateway(auth="jwt", jwt_key=self.KEY))(headers))

    def token(self, key: str = KEY, **claims) -> str:
        return jwt.encode({"sub": "alice", "exp": int(time.time()) + 60} | claims, key, algorithm="HS256")

    def test_a_verified_tokens_sub_is_the_resource(self):
        assert self.identify({"Authorization": f"Bearer {self.token()}"}) == "alice"

    @pytest.mark.parametrize(
        "headers, says",
        [
            ({}, "no bearer token"),
            ({"Authorization": "Basic abc"}, "no bearer token"),
            ({"Authorization": "Bearer not-a-jwt"}, "does not verify"),
            (
                {"Authorization": "Bearer " + jwt.encode({"sub": "alice", "exp": int(time.time()) + 60}, "another key" * 4, algorithm="HS256")},
                "does not verify",
            ),
            ({"Authorization": "Bearer " + jwt.encode({"sub": "alice", "exp": int(time.time()) - 60}, "k" * 32, algorithm="HS256")}, "expired"),
            ({"Authorization": "Bearer " + jwt.encode({"sub": "alice"}, "k" * 32, algorithm="HS256")}, "exp"),
            ({"Authorization": "Bearer " + jwt.encode({"sub": "alice", "exp": int(time.time()) + 60}, "", algorithm="none")}, "does not verify"),
        ],
        ids=["missing", "not bearer", "not a jwt", "forged", "expired", "no exp", "unsigned"],
    )
    def test_a_missing_forged_expired_or_unsigned_token_is_refused(self, headers, says):
        with pytest.raises(Unauthenticated, match=says):
            self.identify(headers)

    def test_behind_a_proxy_the_header_names_the_resource_and_its_absence_is_refused(self):
        identify = resource_of(Gateway(auth="header"))
        assert asyncio.run(identify({"X-Memfilter-Resource": "bob"})) == "bob"
        with pytest.raises(Unauthenticated, match="X-Memfilter-Resource"):
            asyncio.run(identify({}))

    @pytest.mark.parametrize("sub, says", [("a\x00b", "U+0000"), ("x" * 257, "257 characters"), ("", "not an id")], ids=["U+0000", "257", "empty"])
    def test_a_sub_or_header_that_is_not_an_id_is_refused_naming_why(self, sub, says):
        """The resource keys the caller's threads: the rule of every id holds it (`wire.Id`)."""
        with pytest.raises(Unauthenticated, match=f"`sub` .*{re.escape(says)}"):
            self.identify({"Authorization": f"Bearer {self.token(sub=sub)}"})
        if sub:
            with pytest.raises(Unauthenticated, match=f"X-Memfilter-Resource header .*{re.escape(says)}"):
                asyncio.run(resource_of(Gateway(auth="header"))({"X-Memfilter-Resource": sub}))


class TestWhatATokenMustSay:
    """The checks a team's identity provider needs, on a fixed key (the provider's own keys are
    tested against a real OpenID Connect provider: tests/kafka/test_gateway_identity.py)."""

    KEY = "k" * 32

    def identify(self, token: str, **settings) -> str:
        return asyncio.run(resource_of(Gateway(auth="jwt", jwt_key=self.KEY, **settings))({"Authorization": f"Bearer {token}"}))

    def token(self, key=KEY, algorithm="HS256", **claims) -> str:
        return jwt.encode({"sub": "alice", "exp": int(time.time()) + 60} | claims, key, algorithm=algorithm)

    def test_the_issuer_and_an_audience_are_checked_when_set(self):
        good = self.token(iss="https://id.example", aud=["chat", "other"])
        assert self.identify(good, issuer="https://id.example", audience="chat") == "alice"
        with pytest.raises(Unauthenticated, match="not issued by 'https://id.example'"):
            self.identify(self.token(iss="https://evil.example", aud="chat"), issuer="https://id.example", audience="chat")
        with pytest.raises(Unauthenticated, match="not for this gateway: its `aud` is not 'chat'"):
            self.identify(self.token(iss="https://id.example", aud="other"), issuer="https://id.example", audience="chat")
        with pytest.raises(Unauthenticated, match='missing the "aud" claim'):
            self.identify(self.token(iss="https://id.example"), issuer="https://id.example", audience="chat")
        assert self.identify(self.token(aud="anything")) == "alice"  # none set: none checked

    def test_the_resource_comes_from_the_claim_the_setting_names(self):
        token = self.token(tenant="acme")
        assert self.identify(token, resource_claim="tenant") == "acme"
        with pytest.raises(Unauthenticated, match="org"):
            self.identify(token, resource_claim="org")

    def test_a_clock_a_little_behind_is_allowed_the_leeway_and_no_more(self):
        late = self.token(exp=int(time.time()) - 20)
        assert self.identify(late, leeway_s=30) == "alice"
        with pytest.raises(Unauthenticated, match="expired"):
            self.identify(late, leeway_s=5)

    def test_an_hs256_token_made_with_the_public_key_is_refused(self):
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec

        public = ec.generate_private_key(ec.SECP256R1()).public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        header = jwt.utils.base64url_encode(b'{"alg":"HS256","typ":"JWT"}')
        body = jwt.utils.base64url_encode(b'{"sub":"alice","exp":' + str(int(time.time()) + 60).encode() + b"}")
        signature = jwt.utils.base64url_encode(hmac.new(public, header + b"." + body, hashlib.sha256).digest())  # PyJWT would refuse to make it
        forged = (header + b"." + body + b"." + signature).decode()
        with pytest.raises(Unauthenticated, match="does not verify"):
            asyncio.run(resource_of(Gateway(auth="jwt", jwt_key=public.decode()))({"Authorization": f"Bearer {forged}"}))


class TestEachCallerHasItsShare:
    """`memfilter.gateway.limits`, on a clock the test moves."""

    def fairness(self, rate=2.0, burst=3, in_flight=2):
        from memfilter.gateway.limits import Fairness

        self.now = 0.0
        return Fairness(rate, burst, in_flight, lambda: self.now)

    def test_a_burst_passes_then_the_rate_and_retry_after_says_when(self):
        fair = self.fairness()
        assert [fair.admit("a", holds=False) for _ in range(3)] == [None, None, None]
        refused = fair.admit("a", holds=False)
        assert refused is not None and not refused.held and refused.seconds == 0.5 and refused.retry_after() == "1"
        self.now = 0.5  # one token back at 2 a second
        assert fair.admit("a", holds=False) is None and fair.admit("a", holds=False) is not None

    def test_one_callers_flood_leaves_anothers_share_whole(self):
        fair = self.fairness()
        for _ in range(100):
            fair.admit("flood", holds=False)
        assert [fair.admit("other", holds=False) for _ in range(3)] == [None, None, None]

    def test_requests_held_open_are_bounded_and_a_release_frees_one(self):
        fair = self.fairness(burst=10)
        assert fair.admit("a", holds=True) is None and fair.admit("a", holds=True) is None
        refused = fair.admit("a", holds=True)
        assert refused is not None and refused.held and refused.retry_after() == "1"
        assert fair.admit("a", holds=False) is None  # a stop or a read is not held
        fair.release("a")
        assert fair.admit("a", holds=True) is None

    def test_idle_callers_are_forgotten_once_many_are_remembered(self, monkeypatch):
        from memfilter.gateway import limits

        monkeypatch.setattr(limits, "KEPT", 5)
        fair = self.fairness()
        for n in range(5):
            fair.admit(f"c{n}", holds=n == 0)  # c0 holds a request open
        self.now = 10.0  # every bucket full again
        fair.admit("new", holds=False)
        assert set(fair.callers) == {"c0", "new"}


class TestGatewaysShareThePartitions:
    """`memfilter.gateway.shards.owners`: rendezvous hashing over the live gateways, bounded by an even share."""

    GATEWAYS = [f"http://10.0.0.{i}:6068" for i in range(1, 7)]
    CASES = [(partitions, gateways) for partitions in (8, 16, 64) for gateways in range(2, 6)]

    def test_every_gateway_computes_the_same_owners_from_the_same_leases_in_any_order(self):
        assert owners(64, self.GATEWAYS) == owners(64, list(reversed(self.GATEWAYS)))

    @pytest.mark.parametrize(("partitions", "gateways"), CASES)
    def test_no_gateway_reads_more_than_its_even_share_and_each_reads_some(self, partitions, gateways):
        shares = Counter(owners(partitions, self.GATEWAYS[:gateways]))
        assert set(shares) == set(self.GATEWAYS[:gateways]) and max(shares.values()) == -(-partitions // gateways)

    @pytest.mark.parametrize(("partitions", "gateways"), CASES)
    def test_a_gateway_leaving_moves_its_partitions_and_at_most_as_many_others(self, partitions, gateways):
        live = self.GATEWAYS[:gateways]
        before, after = owners(partitions, live), owners(partitions, live[1:])
        moved = {p for p in range(partitions) if before[p] != after[p]}
        held = {p for p in range(partitions) if before[p] == live[0]}
        assert held <= moved and len(moved - held) <= len(held)

    @pytest.mark.parametrize(("partitions", "gateways"), CASES)
    def test_a_gateway_joining_takes_its_share_moving_at_most_as_many_others(self, partitions, gateways):
        live, joining = self.GATEWAYS[:gateways], self.GATEWAYS[gateways]
        before, after = owners(partitions, live), owners(partitions, [*live, joining])
        moved = {p for p in range(partitions) if before[p] != after[p]}
        taken = {p for p in range(partitions) if after[p] == joining}
        assert taken and taken <= moved and len(moved - taken) <= len(taken)

    def test_one_gateway_alone_owns_every_partition(self):
        assert owners(8, self.GATEWAYS[:1]) == self.GATEWAYS[:1] * 8
