"""The committed JSON Schemas are the ones the Structs generate (`python -m memfilter.schemas`)."""

import json

import msgspec
import pytest

from memfilter.schemas.__main__ import render, schema_path
from memfilter.schemas.wire import TOPIC_VALUES, ChatRequest, FilteredInput, json_schemas


@pytest.mark.parametrize("topic", sorted(TOPIC_VALUES))
def test_committed_schema_matches_the_structs(topic):
    committed = schema_path(topic).read_text()
    assert committed == render(json_schemas()[topic]), f"{schema_path(topic)} is stale: run `python -m memfilter.schemas --write`"


def test_every_schema_defines_the_message_it_references():
    for topic, schema in json_schemas().items():
        text = json.dumps(schema)
        for name in ("Message", "Content", "Part", "ToolInvocation"):
            if f"#/$defs/{name}" in text:
                assert name in schema["$defs"], (topic, name)


def test_a_filtered_input_round_trips_through_its_struct():
    raw = msgspec.json.encode(
        {
            "requestId": "q",
            "threadId": "t",
            "resourceId": "r",
            "outcome": "seeded",
            "messages": [{"role": "user", "x": 1}],
            "context": [{"role": "user", "x": 1}],
            "dropped": [{"id": "a", "reason": "r"}],
            "source": {"topic": "chat-requests", "partition": 0, "offset": 3},
            "historyVersion": 2,
            "superseded": ["a0"],
        }
    )
    assert msgspec.json.encode(msgspec.json.decode(raw, type=FilteredInput)) == raw


def test_a_request_keeps_unknown_message_keys():
    raw = b'{"threadId":"t","resourceId":"r","messages":[{"role":"user","zz":{"a":[1]},"content":{"format":2,"parts":[{"type":"x-new","q":1}]}}]}'
    assert msgspec.json.decode(raw, type=ChatRequest).messages[0]["zz"] == {"a": [1]}
