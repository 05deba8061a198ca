"""A filtered input's two formats (`memfilter.core.filtered`): format 2 writes each contributed
message once, and reads back as format 1 exactly; a reference that names nothing is refused."""

from __future__ import annotations

import msgspec
import pytest
from factories import CASES

from memfilter.core.explain import Case, explain_case
from memfilter.core.filtered import BadReference, compact, decode_whole, whole_messages
from memfilter.schemas.wire import FilteredInput, Source

DECIDED = [(c["name"], explain_case(msgspec.json.decode(msgspec.json.encode(c["case"]), type=Case))) for c in CASES]
ACCEPTED = [(name, e) for name, e in DECIDED if e.error is None and e.messages]


def encoded(values: list) -> list:
    return msgspec.json.decode(msgspec.json.encode(values))


class TestFormatTwoWritesEachMessageOnce:
    @pytest.mark.parametrize(("name", "decided"), ACCEPTED, ids=[name for name, _ in ACCEPTED])
    def test_it_reads_back_as_every_message_whole(self, name, decided):
        compacted = encoded(compact(decided.messages, decided.context))
        assert whole_messages(compacted, encoded(decided.context)) == encoded(decided.messages)

    def test_a_message_in_the_context_is_a_reference_and_the_others_stay_whole(self):
        references = whole = 0
        for _, decided in ACCEPTED:
            for m, c in zip(decided.messages, compact(decided.messages, decided.context)):
                if c is m:
                    whole += 1
                    assert not any(x is m for x in decided.context)
                else:
                    references += 1
                    assert c == {"$ref": f"#/context/{next(j for j, x in enumerate(decided.context) if x is m)}"}
        assert references > 0 and whole > 0  # the cases hold both kinds (a message saved in another form stays whole)

    def test_a_record_in_format_two_is_smaller_and_decodes_whole(self):
        _, decided = max(ACCEPTED, key=lambda nd: len(msgspec.json.encode(nd[1].messages)))
        fields = ("r1", "t1", "u1", decided.outcome)
        rest = (decided.context, decided.dropped, Source("chat-requests", 0, 1))
        one = msgspec.json.encode(FilteredInput(*fields, decided.messages, *rest))
        two = msgspec.json.encode(FilteredInput(*fields, compact(decided.messages, decided.context), *rest, format=2))
        assert len(two) < len(one)
        assert msgspec.json.encode(decode_whole(two)) == msgspec.json.encode(decode_whole(one)) == one


class TestAReferenceThatNamesNothingIsRefused:
    @pytest.mark.parametrize("target", ["#/context/5", "#/context/-1", "#/context/", "#/messages/0", "elsewhere", 3])
    def test_a_reference_out_of_the_context_or_to_elsewhere_is_a_validation_error(self, target):
        with pytest.raises(BadReference, match="reference") as raised:
            whole_messages([{"$ref": target}], [{"role": "user"}])
        assert isinstance(raised.value, msgspec.ValidationError)  # refused as any value that does not match

    def test_a_message_with_a_ref_key_and_others_is_a_message(self):
        message = {"$ref": "#/context/9", "role": "user", "content": {"format": 2, "parts": []}}
        assert whole_messages([message], []) == [message]
