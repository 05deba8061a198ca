"""Whatever a record holds, decoding it is a decision or a rejection, never an exception; and
the identities the store keys by (server-assigned ids, hash tags, processed records) cannot be
predicted, shared or spread by a client. Pure: no Kafka, no Redis."""

from __future__ import annotations

import hashlib
import hmac
import json
import tracemalloc
import uuid

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from memfilter.core import origin
from memfilter.core.filter import Rejected, StoredView, check_key, decide, decode_request, lookup_ids
from memfilter.runtime.persister import Persister
from memfilter.runtime.records import Record
from memfilter.store.history import HistoryStore
from memfilter.store.layout import record_field


def request(parts: list | None = None, **fields) -> dict:
    parts = parts if parts is not None else [{"type": "text", "text": "hi"}]
    return {"threadId": "t", "resourceId": "r", "messages": [{"id": "m", "role": "user", "content": {"format": 2, "parts": parts}}], **fields}


def encoded(value: dict, replace: tuple[bytes, bytes] | None = None) -> bytes:
    raw = json.dumps(value).encode()
    return raw.replace(*replace) if replace else raw


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def rejection(raw: bytes | None) -> str:
    with pytest.raises(Rejected) as e:
        decode_request(raw, "q")
    return e.value.type


class TestEveryValueTheContractDoesNotAllowIsRejectedAtDecoding:
    @pytest.mark.parametrize(
        "raw",
        [
            encoded(request([{"type": "text", "text": "aXb"}]), (b"X", b"\xff")),
            encoded(request([{"type": "text", "text": "aXb"}]), (b"X", b"\xed\xa0\x80")),  # an encoded surrogate
            encoded({**request(), "messages": [{"role": "system", "content": {"format": 2, "parts": [{"type": "text", "text": "X"}]}}]}, (b"X", b"\xfe\xff")),
            encoded(request(), (b'"r"', b'"r\\ud800"')),  # an escaped lone surrogate
        ],
        ids=["0xFF in a text part", "ED A0 80 in a text part", "FE FF in a system message", "a lone surrogate escape"],
    )
    def test_a_value_that_is_not_utf8_is_a_decode_error(self, raw):
        assert rejection(raw) == "decode"

    @pytest.mark.parametrize(
        "raw",
        [
            b'{"threadId": "t", "x": ' + nested(10_000).encode() + b"}",
            encoded(request([{"type": "text", "text": "x", "deep": "D"}])).replace(b'"D"', nested(10_000).encode()),
            encoded(request()).replace(b'"format": 2', b'"format": 2, "metadata": {"a": ' + nested(2_000).encode() + b"}"),
            encoded(request()).replace(b'"format": 2', b'"format": 2, "metadata": {"a": ' + nested(900).encode() + b"}"),
        ],
        ids=["10,000 deep at the top", "10,000 deep in a part", "2,000 deep in metadata", "900 deep in metadata"],
    )
    def test_json_nested_too_deeply_is_a_decode_error(self, raw):
        assert rejection(raw) == "decode"

    def test_json_nested_as_deep_as_a_real_tool_result_is_accepted(self):
        raw = encoded(request()).replace(b'"format": 2', b'"format": 2, "metadata": {"a": ' + nested(300).encode() + b"}")
        assert decode_request(raw, "q").shape.threadId == "t"

    def test_a_null_value_is_a_decode_error(self):
        assert rejection(None) == "decode"

    @pytest.mark.parametrize(
        "value",
        [
            request(metadata=None) | {"messages": [{"id": "m", "role": "user", "content": {"format": 2, "parts": [], "metadata": 5}}]},
            request([{"type": "text", "text": "x", "providerMetadata": "openai"}]),
            request([{"type": "text", "text": "x", "providerOptions": [1]}]),
            request([{"type": "text", "text": 5}]),
            request([{"type": "reasoning", "text": {"a": 1}}]),
        ],
        ids=["metadata a number", "providerMetadata a string", "providerOptions a list", "text a number", "reasoning text an object"],
    )
    def test_fields_of_the_wrong_type_are_schema_errors(self, value):
        assert rejection(json.dumps(value).encode()) == "schema"


# Ids a client may get wrong, and where each goes in a request.
BAD = {"U+0000": "t\u0000x", "a newline": "t\nx", "U+007F": "t\u007fx", "257 characters": "x" * 257, "empty": ""}
FIELDS = {
    "threadId": lambda v: request(threadId=v),
    "resourceId": lambda v: request(resourceId=v),
    "requestId": lambda v: request(requestId=v),
    "messageId": lambda v: request(trigger="submit-message", messageId=v),
    "messages[0].id": lambda v: request() | {"messages": [{"id": v, "role": "user", "content": {"format": 2, "parts": []}}]},
    "messages[0].id of a UI message": lambda v: request() | {"messages": [{"id": v, "role": "user", "parts": [{"type": "text", "text": "x"}]}]},
    "messages[0].type": lambda v: request() | {"messages": [{"id": "m", "type": v, "role": "user", "content": {"format": 2, "parts": []}}]},
}


class TestEveryIdIsPrintableAndBoundedWhereverItComesIn:
    """Ids key Redis, Kafka records and PostgreSQL's rows: one rule (`wire.Id`) for every id a
    client or a writer gives, so that none reaches a store that cannot hold it (U+0000 in
    PostgreSQL's text, a key past an index entry's 2,704 bytes)."""

    @pytest.mark.parametrize("field, bad", [(f, b) for f in FIELDS for b in BAD if (f, b) != ("requestId", "257 characters")], ids=str)
    def test_a_request_with_a_bad_id_is_refused_naming_the_field_and_the_rule(self, field, bad):
        with pytest.raises(Rejected) as e:
            decode_request(json.dumps(FIELDS[field](BAD[bad])).encode(), "q")
        assert e.value.type == "schema"
        named = field.split(" ")[0]
        if bad != "empty":
            assert f"`{named}` " in e.value.message and ("an id is printable text" in e.value.message or "an id has 256 at most" in e.value.message), (
                e.value.message
            )

    def test_a_request_id_may_be_long_but_printable(self):
        """It keys no PostgreSQL index, and a reply's save is named after it (`<requestId>/reply`)."""
        assert decode_request(json.dumps(request(requestId="q" * 5000)).encode(), "x").request_id == "q" * 5000
        with pytest.raises(Rejected, match="`requestId` holds the control character U\\+0000 at 5000"):
            decode_request(json.dumps(request(requestId="q" * 5000 + "\u0000")).encode(), "x")

    def test_ids_of_256_characters_of_any_script_pass(self):
        value = request(threadId="🙂" * 256, resourceId="é" * 256, requestId="\u202e" * 256)
        shape = decode_request(json.dumps(value).encode(), "q").shape
        assert (shape.threadId, shape.resourceId) == ("🙂" * 256, "é" * 256)

    @pytest.mark.parametrize("field", ["threadId", "resourceId", "requestId"])
    def test_another_writers_save_with_a_bad_id_is_refused_naming_it(self, field):
        event = {"requestId": "s1", "threadId": "t", "resourceId": "r", "messages": [], field: "t\u0000x"}
        with pytest.raises(Rejected) as e:
            Persister(None, "dlq", b"secret")._decode(Record("persist-messages", 0, 0, 0, b"t", json.dumps(event).encode()))
        assert e.value.type == "schema" and f"`{field}` holds the control character U+0000 at 1" in e.value.message


class TestTheRecordKeyIsTheThreadIdByteForByte:
    @pytest.mark.parametrize("key", [None, b"\xff", b"t\xff", b"T", b""], ids=["null", "not UTF-8", "t then not UTF-8", "another", "empty"])
    def test_any_other_key_is_a_key_mismatch(self, key):
        with pytest.raises(Rejected) as e:
            check_key(decode_request(json.dumps(request()).encode(), "q").shape.threadId, key)
        assert e.value.type == "key-mismatch"

    def test_the_thread_id_in_utf8_is_the_key(self):
        value = request() | {"threadId": "tête"}
        check_key(decode_request(json.dumps(value).encode(), "q").shape.threadId, "tête".encode())


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=30,
)
message_like = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "signal", "tool", 3])},
    optional={
        "id": st.text(max_size=4) | json_values,
        "content": st.fixed_dictionaries(
            {
                "format": st.sampled_from([2, 2, 1]),
                "parts": st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "tool-invocation", "data-x", "step-start"])},
                        optional={
                            "text": json_values,
                            "toolInvocation": st.fixed_dictionaries(
                                {
                                    "state": st.sampled_from(["call", "result", "approval-responded", "partial-call", "bogus"]),
                                    "toolCallId": st.sampled_from(["c1", "c2"]),
                                },
                                optional={"result": json_values},
                            ),
                            "providerMetadata": json_values,
                        },
                    ),
                    max_size=4,
                ),
            },
            optional={"metadata": json_values},
        )
        | json_values,
    },
)
request_like = st.fixed_dictionaries(
    {
        "threadId": st.sampled_from(["t", "t", ""]) | json_values,
        "resourceId": st.sampled_from(["r", "r2"]) | json_values,
        "messages": st.lists(message_like, max_size=5) | json_values,
    },
    optional={"requestId": st.text(max_size=4) | json_values, "retainFullInput": st.booleans() | json_values},
)


def mangle(raw: bytes, how: int, where: int) -> bytes:
    """The value broken as a careless or hostile client might: a byte swapped for one that is
    not UTF-8, deep nesting spliced in, or cut short."""
    where %= max(1, len(raw))
    if how == 1:
        return raw[:where] + b"\xff" + raw[where + 1 :]
    if how == 2:
        return raw[:where] + nested(3_000).encode() + raw[where:]
    if how == 3:
        return raw[:where]
    return raw


STORED = {
    "m": json.dumps(
        {
            "id": "m",
            "role": "assistant",
            "content": {
                "format": 2,
                "parts": [{"type": "tool-invocation", "toolInvocation": {"state": "call", "toolCallId": "c1", "toolName": "f", "args": {}}}],
            },
        }
    ).encode(),
}


def decide_or_reject(raw: bytes | None) -> str:
    """What the worker does with a value before Redis is written: a decision or a rejection."""
    try:
        req = decode_request(raw, "chat-requests-0-0")
        check_key(req.shape.threadId, b"t")
    except Rejected as e:
        return e.type
    for view in (StoredView({}, {}), StoredView({i: STORED[i] for i in lookup_ids(req) if i in STORED}, {}, "r", 3)):
        decision = decide(req, view, 0)
        msgspec.json.encode(decision.messages), [msgspec.json.encode(row) for row in decision.persist]
    return decision.outcome


class TestNothingADecodeMeetsRaises:
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.binary(max_size=200))
    def test_arbitrary_bytes_are_a_decision_or_a_rejection(self, raw):
        assert decide_or_reject(raw)

    @settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(request_like, st.integers(0, 3), st.integers(0, 10_000))
    def test_arbitrary_json_shaped_like_a_request_is_a_decision_or_a_rejection(self, value, how, where):
        assert decide_or_reject(mangle(json.dumps(value).encode(), how, where))

    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(
        st.fixed_dictionaries(
            {
                "requestId": st.text(max_size=3) | json_values,
                "threadId": st.just("t") | json_values,
                "resourceId": st.just("r") | json_values,
                "messages": st.lists(message_like, max_size=3) | json_values,
            }
        ),
        st.integers(0, 3),
        st.integers(0, 10_000),
        st.booleans(),
    )
    def test_arbitrary_persist_events_decode_to_an_event_or_a_rejection(self, value, how, where, claims_origin):
        raw = mangle(json.dumps(value).encode(), how, where)
        headers = (origin.ORIGIN,) if claims_origin else ()
        try:
            Persister(None, "dlq", b"secret")._decode(Record("persist-messages", 0, 0, 0, b"t", raw, headers))
        except Rejected as e:
            assert e.type in {"decode", "schema", "key-mismatch", "thread-mismatch", "origin"}


# What an id may be (`memfilter.schemas.wire.Id`): printable text of 1 to 20 characters here.
ids = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=[*map(chr, range(32)), "\x7f"]), min_size=1, max_size=20)


def every_key(thread: str) -> tuple[str, ...]:
    """A thread's keys, every one (`ThreadKeys`), under the default prefix."""
    return msgspec.structs.astuple(HistoryStore(None, "mf").keys(thread))


class TestIdentitiesNoClientCanTakeOver:
    def test_server_assigned_ids_depend_on_the_deployments_secret(self):
        raw = json.dumps({"threadId": "t", "resourceId": "r", "messages": [{"role": "user", "content": {"format": 2, "parts": []}}]}).encode()
        ours, again = decode_request(raw, "q", id_key=b"ours" * 8).ids, decode_request(raw, "q", id_key=b"ours" * 8).ids
        guessed = [decode_request(raw, "q", id_key=key).ids for key in (b"", b"memfilter", b"theirs" * 8)]
        assert ours == again and all(ours != g for g in guessed)

    @settings(max_examples=300)
    @given(ids, ids, st.binary(max_size=40))
    def test_server_assigned_ids_stay_the_uuids_of_their_keyed_hash(self, thread, request_id, secret):
        """A replay of an old request must find its rows under the ids it was given then."""
        raw = json.dumps(
            {
                "threadId": thread,
                "requestId": request_id,
                "resourceId": "r",
                "messages": [{"role": "system", "content": {"format": 2, "parts": []}}, {"role": "user", "content": {"format": 2, "parts": []}}],
            }
        ).encode()
        digest = hmac.digest(secret, f"{thread}\n{request_id}\n1".encode(), hashlib.sha256)
        assert decode_request(raw, "q", id_key=secret).ids == [None, str(uuid.UUID(bytes=digest[:16], version=4))]

    @settings(max_examples=300)
    @given(st.text(min_size=1, max_size=20))
    def test_every_key_of_a_thread_is_in_one_cluster_slot(self, thread):
        assert len({key_slot(k.encode()) for k in every_key(thread)}) == 1

    @pytest.mark.parametrize("thread", ["}x", "{x}", "a}b{c", "%7D", "}"])
    def test_a_thread_id_with_braces_keeps_its_keys_together_and_apart_from_others(self, thread):
        keys = every_key(thread)
        assert len({key_slot(k.encode()) for k in keys}) == 1
        assert all(k.startswith("mf:t:{") and k.count("{") == 1 and k.count("}") == 1 for k in keys)

    @settings(max_examples=300)
    @given(st.text(max_size=6), st.text(max_size=6))
    def test_distinct_thread_ids_never_share_keys(self, a, b):
        if a != b:
            assert set(every_key(a)).isdisjoint(every_key(b))

    def test_a_processed_record_is_kept_under_the_resource_and_the_request_id(self):
        assert record_field("r1", "q") != record_field("r2", "q")
        assert record_field("a\nb", "c") != record_field("a", "b\nc")


class TestNoClientFillsTheWorkersMemory:
    def test_long_thread_ids_leave_no_key_names_behind(self):
        """The store keeps the key names of the threads it sees (a batch names each several
        times); a thread id is the client's, so a long one must not be kept."""
        store = HistoryStore(None, "mf")
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i in range(100):
                store.keys(f"{i}-" + "x" * 100_000)  # 7 names of ~100 KB each
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert grown < 1_000_000

    def test_the_key_names_kept_are_the_ones_made(self):
        store = HistoryStore(None, "mf")
        keys = store.keys("t1")
        assert keys == store.keys("t1")
        assert [keys.rows, keys.order, keys.meta, keys.saved, keys.recent, keys.superseded, keys.tokens] == [
            f"mf:t:{{t1}}:{n}" for n in ("rows", "order", "meta", "saved", "recent", "superseded", "tokens")
        ]
