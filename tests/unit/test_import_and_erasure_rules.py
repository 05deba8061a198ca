"""The pure rules of history coming in and leaving: reading exports (`memfilter.core.exports`),
an erased thread's requests (`memfilter.core.filter`), and the operator's mark
(`memfilter.core.origin`). Mastra's real storage makes the exports the kafka tier imports
(tests/kafka/test_import_and_forget.py); these pin each rule on its own."""

from __future__ import annotations

import json

import msgspec
from factories import SECRET, T0, msg

from memfilter.core import origin
from memfilter.core.exports import read_export, with_created_at
from memfilter.core.filter import StoredView, decide, decode_request
from memfilter.store.layout import Keys


def lines(*rows: dict) -> list[bytes]:
    return [json.dumps(r).encode() for r in rows]


THREAD = {"id": "t1", "resourceId": "r1", "title": "t", "metadata": {}, "createdAt": "2026-01-01T00:00:00.000Z", "updatedAt": "2026-01-01T00:00:00.000Z"}


def mastra_row(mid: str, role: str, content, created: str, **extra) -> dict:
    return {"id": mid, "thread_id": "t1", "content": content, "role": role, "type": "v2", "createdAt": created, **extra}


class TestReadingAMastraStorageExport:
    def test_reads_rows_as_mastra_does_content_parsed_in_created_at_order_owned_by_the_thread_rows_resource(self):
        later = mastra_row("a1", "assistant", json.dumps(msg(None, "assistant", "hi")["content"]), "2026-01-01T00:00:02.000Z")
        earlier = mastra_row("u1", "user", json.dumps(msg(None)["content"]), "2026-01-01T00:00:01.000Z", resourceId=None)
        [t] = read_export(lines(later, THREAD, earlier))
        assert (t.thread, t.resource, t.problems) == ("t1", "r1", [])
        assert [r["id"] for r in t.rows] == ["u1", "a1"]
        assert t.rows[0] == {
            "id": "u1",
            "type": "v2",
            "createdAt": "2026-01-01T00:00:01.000Z",
            "threadId": "t1",
            "content": msg(None)["content"],
            "role": "user",
            "resourceId": "r1",
        }

    def test_a_plain_string_content_becomes_a_text_part_as_mastras_parse_stored_message_makes_it(self):
        [t] = read_export(lines(THREAD, mastra_row("u1", "user", "just words", "2026-01-01T00:00:01.000Z")))
        assert t.rows[0]["content"] == {"format": 2, "content": "just words", "parts": [{"type": "text", "text": "just words"}]}

    def test_a_thread_without_its_thread_row_or_with_a_message_of_another_resource_is_reported_not_read(self):
        [orphan] = read_export(lines(mastra_row("u1", "user", "x", "2026-01-01T00:00:01.000Z")))
        assert orphan.problems and "no resource" in orphan.problems[0]
        [mixed] = read_export(lines(THREAD, mastra_row("u1", "user", "x", "2026-01-01T00:00:01.000Z", resourceId="r2")))
        assert any("names resource 'r2'" in p for p in mixed.problems)

    def test_system_messages_are_left_out_as_the_processor_never_stores_them(self):
        [t] = read_export(
            lines(THREAD, mastra_row("s1", "system", "be brief", "2026-01-01T00:00:00.500Z"), mastra_row("u1", "user", "x", "2026-01-01T00:00:01Z"))
        )
        assert [r["id"] for r in t.rows] == ["u1"] and t.problems == []


class TestReadingUIMessages:
    def test_converts_each_message_as_the_processor_converts_a_requests(self):
        ui = {
            "id": "a1",
            "role": "assistant",
            "parts": [{"type": "tool-lookup", "toolCallId": "c1", "state": "output-available", "input": {"q": 1}, "output": 2}],
        }
        [t] = read_export(
            lines({"threadId": "t1", "resourceId": "r1", "messages": [{"id": "u1", "role": "user", "parts": [{"type": "text", "text": "hi"}]}, ui]})
        )
        assert t.problems == [] and [r["id"] for r in t.rows] == ["u1", "a1"]
        inv = t.rows[1]["content"]["parts"][0]["toolInvocation"]
        assert (inv["state"], inv["toolName"], inv["args"], inv["result"]) == ("result", "lookup", {"q": 1}, 2)
        assert (t.rows[1]["threadId"], t.rows[1]["resourceId"]) == ("t1", "r1")

    def test_a_message_is_dated_by_its_created_at_or_else_by_its_metadatas_as_mastra_writes_it(self):
        dated = {"id": "u1", "role": "user", "parts": [], "metadata": {"createdAt": "2026-01-05T10:00:01.000Z"}}
        [t] = read_export(lines({"threadId": "t1", "resourceId": "r1", "messages": [dated, {"id": "u2", "role": "user", "parts": []}]}))
        assert [r.get("createdAt") for r in t.rows] == ["2026-01-05T10:00:01.000Z", None]

    def test_a_message_without_an_id_or_with_an_unreadable_part_is_reported_with_its_line(self):
        [t] = read_export(lines({"threadId": "t1", "resourceId": "r1", "messages": [{"role": "user", "parts": [{"type": "text", "text": "hi"}]}]}))
        assert t.problems == ["line 1: messages[0]: no id; an imported message keeps the id its clients know it by"]
        [t] = read_export(
            lines({"threadId": "t1", "resourceId": "r1", "messages": [{"id": "a", "role": "assistant", "parts": [{"type": "tool-x", "state": "odd"}]}]})
        )
        assert "state is 'odd'" in t.problems[0]

    def test_an_id_no_request_may_carry_is_reported_by_line_and_its_thread_not_read(self):
        """The rule of every id (`wire.Id`) holds an import as it holds a request."""
        found = read_export(
            [
                *lines({"threadId": "t\x00", "resourceId": "r1", "messages": []}),
                *lines({"threadId": "t2", "resourceId": "r" * 300, "messages": []}),
                *lines({"threadId": "t3", "resourceId": "r1", "messages": [{"id": "u\n", "role": "user", "parts": []}]}),
            ]
        )
        problems = {t.thread: t.problems for t in found}
        assert problems[""] == ["line 1: the thread id holds the control character U+0000 at 1; an id is printable text"]
        assert problems["t2"][0] == "line 2: the resourceId is 300 characters; an id has 256 at most"
        assert len(problems["t3"]) == 1 and problems["t3"][0].startswith("line 3: messages[0]: not a stored message")

    def test_lines_that_are_no_export_are_reported_and_the_threads_that_are_still_read(self):
        found = read_export([b"{oops", b"[1]", *lines({"threadId": "t1", "resourceId": "r1", "messages": [{"id": "u", "role": "user", "parts": []}]})])
        assert [t.thread for t in found] == ["t1", ""]
        assert found[0].problems == [] and len(found[1].problems) == 2


class TestDatesOfImportedRows:
    def test_a_row_without_a_date_takes_its_stored_rows_so_an_import_again_writes_the_same_bytes(self):
        rows = [{"id": "u1", "role": "user"}, {"id": "u2", "role": "user", "createdAt": "2026-01-01T00:00:00.000Z"}, {"id": "u3", "role": "user"}]
        first = with_created_at(rows, {}, T0, None)
        assert [r["createdAt"] for r in first] == ["2026-03-01T12:00:00.000Z", "2026-01-01T00:00:00.000Z", "2026-03-01T12:00:00.001Z"]
        assert with_created_at(rows, {r["id"]: r for r in first}, T0 + 5000, None) == first

    def test_new_dates_come_after_the_threads_newest_row(self):
        assert with_created_at([{"id": "u1"}], {}, T0, T0 + 10)[0]["createdAt"] == "2026-03-01T12:00:00.011Z"


def request(*messages: dict) -> object:
    return decode_request(msgspec.json.encode({"threadId": "t1", "resourceId": "r1", "messages": list(messages)}), "q")


ERASED = StoredView(rows={}, elsewhere={}, erased=True, tail=[])


class TestAnErasedThread:
    def test_refuses_a_stale_tabs_full_echo_never_taking_it_for_the_seed_of_an_empty_thread(self):
        echo = request(msg("u1"), msg("a1", "assistant"), msg("u2"))
        for reopen in (False, True):
            d = decide(echo, ERASED, T0, reopen_erased=reopen)
            assert d.error is not None and d.error.type == "erased" and d.persist == []

    def test_refuses_even_a_new_first_message_unless_the_operator_allows_a_restart(self):
        first = request(msg("sys", "system", "be brief"), msg("n1"))
        assert decide(first, ERASED, T0).error.type == "erased"
        d = decide(first, ERASED, T0, reopen_erased=True)
        assert d.error is None and [r["id"] for r in d.persist] == ["n1"]

    def test_says_what_happened_and_what_to_do(self):
        assert decide(request(msg("n1")), ERASED, T0).error.message == (
            "thread t1 was erased (memfilter forget): its history is gone and it takes no more requests; start a new thread"
        )


class TestTheOperatorsMark:
    VALUE = b'{"requestId":"e","threadId":"t1","resourceId":"r1","messages":[]}'

    def test_verifies_under_the_secret_and_not_under_another(self):
        headers = origin.operator_headers(self.VALUE, SECRET)
        assert origin.is_operators(self.VALUE, headers, SECRET)
        assert not origin.is_operators(self.VALUE, headers, b"another-secret-0123456789")
        assert not origin.is_operators(self.VALUE + b" ", headers, SECRET)

    def test_is_not_the_processors_mark_nor_made_from_it(self):
        processors = origin.headers(self.VALUE, SECRET)
        assert not origin.is_operators(self.VALUE, [origin.OPERATOR, processors[1]], SECRET)
        operators = origin.operator_headers(self.VALUE, SECRET)
        assert not origin.is_processors(self.VALUE, [origin.ORIGIN, operators[1]], SECRET)

    def test_needs_a_secret(self):
        assert not origin.is_operators(self.VALUE, origin.operator_headers(self.VALUE, b""), b"")


class TestFindingAResourcesThreads:
    def test_a_meta_key_names_its_thread_whatever_braces_or_escapes_the_id_holds(self):
        keys = Keys("mf:x")
        for thread in ("t1", "a{b}c", "%7B", "}{", "50%"):
            assert keys.thread_of_meta(keys.keys(thread).meta) == thread


class TestReadingMastrasWorkingMemory:
    RESOURCE = {"id": "r1", "workingMemory": "# User\n- Name: Sam", "metadata": {}, "createdAt": "2026-01-01T00:00:00.000Z"}

    def test_a_resources_document_comes_in_with_the_first_of_its_threads_with_scope_resource(self):
        other = {**THREAD, "id": "t2"}
        [t1, t2] = read_export(lines(THREAD, other, self.RESOURCE), "resource")
        assert (t1.working_memory, t2.working_memory) == ("# User\n- Name: Sam", None)

    def test_a_threads_document_comes_from_its_metadata_with_scope_thread(self):
        [t] = read_export(lines({**THREAD, "metadata": json.dumps({"workingMemory": "t1's"})}, self.RESOURCE), "thread")
        assert t.working_memory == "t1's"

    def test_none_comes_in_with_working_memory_off(self):
        [t] = read_export(lines({**THREAD, "metadata": {"workingMemory": "t1's"}}, self.RESOURCE))
        assert t.working_memory is None and t.problems == []

    def test_a_resources_document_no_thread_of_the_export_brings_is_reported(self):
        *_, bad = read_export(lines(THREAD, {**self.RESOURCE, "id": "r9"}), "resource")
        assert bad.problems == ["line 2: the working memory of resource r9: no thread of it in the export brings it in"]
