"""Working memory's rules (`memfilter.core.working_memory`) against Mastra's own code
(@mastra/memory 1.31.0, in Node: tests/node/working_memory.mjs): its templates, its system
instruction to the byte, its merge, and what its updateWorkingMemory tool stores or refuses,
on examples and on random documents and calls."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest

from memfilter.core.working_memory import DEFAULT_TEMPLATE, SKIPPED_EMPTY, Refused, Updated, call_bytes, instruction, merge, template_of, tool, update

NODE = Path(__file__).parents[1] / "node"

PROFILE = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "prefs": {"type": "object", "properties": {"style": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}}},
        "pets": {"type": "array", "items": {"type": "object", "properties": {"kind": {"type": "string"}}}},
        "vip": {"type": "boolean", "default": False},
    },
}
STRICT = {"type": "object", "properties": {"id": {"type": "string"}, "notes": {"type": "object"}}, "required": ["id"]}
SCHEMAS = [PROFILE, STRICT]
MARKDOWN = ["# Me\n- Name:\n- City:", "  \n Facts:\n\n", None]


def mastra(**document: list) -> dict[str, list]:
    """What tests/node/working_memory.mjs answers, from Mastra's code."""
    empty: dict[str, list] = {"templates": [], "instructions": [], "merges": [], "calls": []}
    done = subprocess.run(["node", "working_memory.mjs"], cwd=NODE, input=json.dumps(empty | document).encode(), capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def config(markdown: str | None = None, schema: dict | None = None) -> dict[str, Any]:
    return {k: v for k, v in (("template", markdown), ("schema", schema)) if v is not None}


def value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value, as a model might put in a call: nulls, wrong types, nesting."""
    kind = rng.choice(["str", "int", "null", "list", "dict", "bool"] if depth < 2 else ["str", "int", "null", "bool"])
    if kind == "list":
        return [value(rng, depth + 1) for _ in range(rng.randint(0, 2))]
    if kind == "dict":
        return {rng.choice(["style", "tags", "kind", "x"]): value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return {"str": rng.choice(["", "Sam", "Berlin"]), "int": rng.randint(-2, 40), "null": None, "bool": rng.random() < 0.5}[kind]


def document(rng: random.Random) -> dict[str, Any]:
    keys = ["name", "age", "prefs", "pets", "vip", "id", "notes", "extra"]
    return {k: value(rng) for k in rng.sample(keys, rng.randint(0, 4))}


class TestTheTemplateIsMastras:
    def test_a_schema_is_its_draft_07_json_and_markdown_is_trimmed_or_mastras_default(self):
        cases = [config(schema=s) for s in SCHEMAS] + [config(markdown=m) for m in MARKDOWN]
        expected = mastra(templates=cases)["templates"]
        assert [{"format": t.format, "content": t.content} for t in (template_of(c.get("template"), c.get("schema")) for c in cases)] == expected
        assert template_of().content == DEFAULT_TEMPLATE.strip()

    def test_a_template_and_a_schema_together_are_refused_by_name(self):
        with pytest.raises(ValueError, match="a Markdown template or a JSON Schema, not both"):
            template_of("# Me", PROFILE)


class TestTheInstructionIsMastrasToTheByte:
    def test_for_markdown_and_for_a_schema_written_or_never_written(self):
        cases = [
            config(**_kw) | {"data": data}
            for _kw in ({"schema": PROFILE}, {"schema": STRICT}, {"markdown": MARKDOWN[0]}, {})
            for data in (None, '{"name":"Sam"}', "# Me\n- Name: Sam")
        ]
        expected = mastra(instructions=cases)["instructions"]
        got = [instruction(template_of(c.get("template"), c.get("schema")), c["data"]) for c in cases]
        for mine, theirs in zip(got, expected, strict=True):
            assert mine == theirs


class TestTheMergeIsMastras:
    def test_objects_merge_key_by_key_null_deletes_and_arrays_replace(self):
        assert merge({"a": {"b": 1, "c": [1]}, "d": 2}, {"a": {"c": [2], "e": None}, "d": None, "f": {"g": None}}) == {"a": {"b": 1, "c": [2]}, "f": {}}

    def test_on_random_documents(self):
        rng = random.Random(59)
        pairs = [[rng.choice([None, document(rng)]), rng.choice([None, [], document(rng)])] for _ in range(300)]
        expected = mastra(merges=pairs)["merges"]
        assert [merge(a, b) for a, b in pairs] == expected


class TestTheToolStoresAndRefusesAsMastrasDoes:
    def test_an_empty_template_never_replaces_a_document_that_says_something(self):
        template = template_of()
        assert update(template, "# Me\n- Name: Sam", {"memory": " " + DEFAULT_TEMPLATE.replace("\n", "\n\n")}) == Updated(None, False, SKIPPED_EMPTY)
        assert update(template, None, {"memory": DEFAULT_TEMPLATE}) == Updated(DEFAULT_TEMPLATE, True)

    def test_a_null_of_an_optional_field_is_dropped_before_the_merge_so_it_deletes_nothing(self):
        stored = '{"name":"Sam","prefs":{"style":"formal"}}'
        assert update(template_of(schema=PROFILE), stored, {"memory": {"prefs": {"style": None}, "age": 3}}) == Updated(
            '{"name":"Sam","prefs":{"style":"formal"},"age":3}', True
        )

    def test_a_call_that_breaks_the_schema_is_refused_and_changes_nothing(self):
        assert isinstance(update(template_of(schema=STRICT), '{"id":"a"}', {"memory": {"notes": {}}}), Refused)
        assert isinstance(update(template_of(), "# Me", {"memory": {"name": "Sam"}}), Refused)

    def test_on_random_calls(self):
        rng = random.Random(1959)
        calls = []
        for _ in range(400):
            schema = rng.choice([*SCHEMAS, None])
            markdown = rng.choice(MARKDOWN) if schema is None else None
            existing = (
                rng.choice([None, "", json.dumps(document(rng), separators=(",", ":")), "not json"])
                if schema
                else rng.choice([None, "", "# Me\n- Name: Sam", (markdown or DEFAULT_TEMPLATE).strip()])
            )
            memory = document(rng) if schema else rng.choice(["# Me\n- Name: Al", (markdown or DEFAULT_TEMPLATE) + "\n\n", "", 5, {"a": 1}])
            given = rng.choice([{"memory": memory}, {"memory": memory}, memory, {"memory": None}, {}])
            calls.append(config(markdown, schema) | {"existing": existing, "given": given})
        expected = mastra(calls=calls)["calls"]
        for c, theirs in zip(calls, expected, strict=True):
            mine = update(template_of(c.get("template"), c.get("schema")), c["existing"], c["given"])
            answer = theirs["answer"]
            if isinstance(mine, Refused):
                assert answer.get("error") is True and theirs["stored"] == c["existing"], (c, theirs)
            else:
                assert answer.get("error") is None, (c, theirs, mine)
                assert (answer["success"], answer.get("message")) == (mine.success, mine.message), (c, theirs, mine)
                assert theirs["stored"] == (c["existing"] if mine.document is None else mine.document), (c, theirs, mine)


class TestTheToolIsMastras:
    def test_its_name_description_and_input_schema_for_markdown_and_for_a_schema(self):
        cases = [config(m) for m in MARKDOWN] + [config(schema=s) for s in SCHEMAS]
        theirs = mastra(tools=cases)["tools"]
        ours = [tool(template_of(c.get("template"), c.get("schema"))) for c in cases]
        assert ours == theirs


class TestACallsSizeIsWhatItsEventCarries:
    def test_is_its_arguments_as_msgspec_writes_them_not_as_the_model_wrote_them(self):
        given = json.loads('{"memory": "x", "n": [1E9, 2E9]}')
        assert call_bytes(given) == len(b'{"memory":"x","n":[1000000000.0,2000000000.0]}')

    def test_a_lone_surrogate_no_event_can_carry_is_a_value_error(self):
        with pytest.raises(ValueError):
            call_bytes(json.loads('{"memory": "\\ud800"}'))
