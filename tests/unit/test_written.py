"""Where the task loop notes what its own committed transactions wrote (`memfilter.runtime.written`):
an offset is held only inside a span noted, and spans go once consumed past or revoked."""

from __future__ import annotations

from aiokafka import TopicPartition

from memfilter.runtime.written import Written

SAVES = TopicPartition("persist-messages", 3)


def noted(*spans: tuple[int, int]) -> Written:
    written = Written()
    for first, count in spans:
        written.add(SAVES, first, count)
    return written


class TestHeldOffsets:
    def test_holds_exactly_the_offsets_of_each_span_noted(self):
        written = noted((10, 3), (20, 2))
        assert [o for o in range(0, 30) if written.holds(SAVES, o)] == [10, 11, 12, 20, 21]

    def test_holds_nothing_of_another_partition_or_topic(self):
        written = noted((0, 5))
        assert not written.holds(TopicPartition("persist-messages", 4), 2)
        assert not written.holds(TopicPartition("chat-requests", 3), 2)


class TestLettingGo:
    def test_spans_consumed_past_are_let_go_and_the_rest_kept(self):
        written = noted((10, 3), (20, 2))
        written.consumed({SAVES: 13})
        assert not written.holds(SAVES, 12)
        assert written.holds(SAVES, 20) and written.holds(SAVES, 21)

    def test_a_span_consumed_partly_is_kept_whole(self):
        written = noted((10, 3))
        written.consumed({SAVES: 11})
        assert written.holds(SAVES, 10) and written.holds(SAVES, 12)

    def test_revoked_partitions_take_every_span_with_them(self):
        written = noted((10, 3))
        written.clear()
        assert not written.holds(SAVES, 10)
