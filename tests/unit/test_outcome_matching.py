"""A client finds its request's outcome by where the request landed, not by its request id,
which any client can send; a record that says nothing of a request is passed over."""

from __future__ import annotations

import msgspec
from aiokafka.structs import ConsumerRecord

from memfilter.client import outcome_of
from memfilter.core.filter import Rejection
from memfilter.schemas.wire import FilteredInput, Source
from memfilter.settings import Topics

TOPICS = Topics()


def record(topic: str, value: bytes | None, headers: list[tuple[str, bytes]] = ()) -> ConsumerRecord:
    return ConsumerRecord(topic, 0, 0, 0, 0, b"t", value, None, 0, 0, list(headers))


def test_a_filtered_input_answers_the_position_of_its_source_whatever_its_request_id():
    event = FilteredInput("mine", "t", "r", "unchanged", [], [], [], Source(TOPICS.requests, 3, 41), 0)
    assert outcome_of(record(TOPICS.filtered, msgspec.json.encode(event)), TOPICS) == ((3, 41), event)


def test_a_dead_letter_answers_the_position_it_names_with_its_reason():
    headers = [
        ("error.type", b"ownership"),
        ("error.message", b"not yours"),
        ("source.topic", TOPICS.requests.encode()),
        ("source.partition", b"2"),
        ("source.offset", b"7"),
    ]
    assert outcome_of(record(TOPICS.dlq, b'{"requestId": "mine"}', headers), TOPICS) == ((2, 7), Rejection("ownership", "not yours"))


def test_records_that_say_nothing_of_a_request_are_passed_over():
    persist_dead = [("error.type", b"ownership"), ("source.topic", TOPICS.persist.encode()), ("source.partition", b"0"), ("source.offset", b"1")]
    forged = [("source.topic", TOPICS.requests.encode()), ("source.partition", b"x"), ("source.offset", b"1")]
    for r in (record(TOPICS.filtered, None), record(TOPICS.filtered, b"{not json"), record(TOPICS.dlq, None, persist_dead), record(TOPICS.dlq, b"", forged)):
        assert outcome_of(r, TOPICS) is None
