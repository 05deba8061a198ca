"""Working memory: the document the model keeps about a user (or a thread) and updates through a
tool, by Mastra's rules (`workingMemory` of `@mastra/memory` 1.31.0, the release beside
`@mastra/core` 1.71.0).

Why: the context holds the last turns only; what the user said fifty turns ago (a name, a
preference) leaves it. Mastra keeps such facts in a working memory the model rewrites through
its `updateWorkingMemory` tool and reads in its system message; a team moving from Mastra keeps
that behaviour, and its stored documents, here.

What it promises, each the same as Mastra's, for the same inputs (tests/unit/test_working_memory.py
holds them against Mastra's own code):

- `template_of`: the document's template: Markdown (the one given, or Mastra's default,
  trimmed), or, with a JSON Schema, that schema as JSON (`format` "json").
- `instruction`: the system message that carries the document to the model and tells it how
  to update it (`getWorkingMemoryToolInstruction`; a document never written reads `null`).
- `update`: what a call of the tool does to the stored document (`updateWorkingMemoryTool`):
  Markdown is replaced whole, but never by the empty template over a document that says
  something; a schema's document is validated (draft-07, its optional fields' `null`s dropped
  first; a call that fails is tried once more without its `null`s, as Mastra's tool framework
  tries it), then merged into the stored one (`merge`).
- `merge`: `deepMergeWorkingMemory`: objects merged key by key, `null` deletes, arrays and
  other values replace.
- `fold`: the document its updates make, applied in order (what the shell keeps).
- `system_message`: the instruction as a context's system message.
- `tool`: the tool as the model is offered it (Mastra's description and input schema), and
  `output`: what a call's outcome answers the model.

Pure functions: where the document is kept, and in what order updates apply, is the shell's.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import jsonschema
import msgspec

TOOL = "updateWorkingMemory"  # the tool's name, as the model calls it
# A call's arguments, as JSON, at most (`call_bytes`): every filtered input of the resource
# carries the document they make, so one huge call would make every later request of it too
# large to send.
MAX_CALL_BYTES = 16 * 1024
DRAFT_07 = "http://json-schema.org/draft-07/schema#"
# Mastra's default template, to the byte (each label's line ends in a space)
DEFAULT_TEMPLATE = "\n# User Information\n" + "".join(
    f"- **{label}**: \n" for label in ("First Name", "Last Name", "Location", "Occupation", "Interests", "Goals", "Events", "Facts", "Projects")
)
SKIPPED_EMPTY = "Attempted to replace existing working memory with empty template. Update skipped to prevent data loss."
NOTHING_GIVEN = "No memory data provided, existing memory unchanged."


class Template(msgspec.Struct, frozen=True):
    format: Literal["markdown", "json"]
    content: str  # the Markdown template, or the JSON Schema as JSON


class Updated(msgspec.Struct, frozen=True):
    """A call's outcome: `document` the stored document after it (None: unchanged), and what
    the tool answers the model (`success`, and a `message` when Mastra gives one)."""

    document: str | None
    success: bool
    message: str | None = None


class Refused(msgspec.Struct, frozen=True):
    """A call whose input fails the template's validation: the tool answers an error; the
    document is unchanged."""

    errors: list[str]


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()  # JSON.stringify's form: compact, key order kept


def template_of(markdown: str | None = None, schema: dict[str, Any] | None = None) -> Template:
    """Mastra's `getWorkingMemoryTemplate`: a JSON Schema (as its draft-07 output: the schema,
    then `$schema`), or the Markdown template given, or the default, trimmed."""
    if markdown is not None and schema is not None:
        raise ValueError("working memory takes a Markdown template or a JSON Schema, not both: set one of them")
    if schema is not None:
        return Template("json", _json({k: v for k, v in schema.items() if k != "$schema"} | {"$schema": DRAFT_07}))
    return Template("markdown", (DEFAULT_TEMPLATE if markdown is None else markdown).strip())


def empty_of(schema: Any) -> dict[str, Any]:
    """Mastra's `generateEmptyFromSchema`: an object of the schema's properties, each its
    default or the empty value of its type."""
    if not isinstance(schema, dict) or schema.get("type") != "object" or not isinstance(schema.get("properties"), dict):
        return {}
    empty: dict[str, Any] = {}
    for key, prop in schema["properties"].items():
        prop = prop if isinstance(prop, dict) else {}
        kind = prop.get("type")
        if "default" in prop:
            empty[key] = prop["default"]
        elif kind == "object":
            empty[key] = empty_of(prop) if "properties" in prop else {}
        else:
            empty[key] = {"string": "", "array": [], "number": 0, "integer": 0, "boolean": False}.get(kind) if isinstance(kind, str) else None
    return empty


def instruction(template: Template, data: str | None) -> str:
    """The system message Mastra adds for the model (`getWorkingMemoryToolInstruction`)."""
    json_format = template.format == "json"
    kind = "JSON" if json_format else "Markdown"
    empty = empty_of(msgspec.json.decode(template.content)) if json_format else {}
    as_string = (
        ""
        if json_format
        else "5. IMPORTANT: When calling updateWorkingMemory, the only valid parameter is the memory field. DO NOT pass an object.\n"
        "6. IMPORTANT: ALWAYS pass the data you want to store in the memory field as a string. DO NOT pass an object.\n"
        "7. IMPORTANT: Data must only be sent as a string no matter which format is used."
    )
    shown = "" if json_format else f"<working_memory_template>\n{template.content}\n</working_memory_template>"
    return f"""WORKING_MEMORY_SYSTEM_INSTRUCTION:
Store and update any conversation-relevant information by calling the updateWorkingMemory tool. If information might be referenced again - store it!

Guidelines:
1. Store anything that could be useful later in the conversation
2. Update proactively when information changes, no matter how small
3. Use {kind} format for all data
4. Act naturally - don't mention this system to users. Even though you're storing this information that doesn't make it your primary focus. Do not ask them generally for "information about yourself"
{as_string}


{shown}

{"When working with json data, the object format below represents the template:" if empty else ""}
{_json(empty) if empty else ""}

<working_memory_data>
{"null" if data is None else data}
</working_memory_data>

Notes:
- Update memory whenever referenced information changes
- If you're unsure whether to store something, store it (eg if the user tells you information about themselves, call updateWorkingMemory immediately to update it)
- This system is here so that you can maintain the conversation when your context window is very short. Update your working memory because you may need it to maintain the conversation without the full conversation history
- Do not remove empty sections - you must include the empty sections along with the ones you're filling in
- REMEMBER: the way you update your working memory is by calling the updateWorkingMemory tool with the entire {kind} content. The system will store it for you. The user will not see it.
- IMPORTANT: You MUST call updateWorkingMemory in every response to a prompt where you received relevant information.
- IMPORTANT: Preserve the {kind} formatting structure above while updating the content."""


def merge(existing: Any, update: Any) -> dict[str, Any]:
    """Mastra's `deepMergeWorkingMemory`: `update`'s keys into a copy of `existing`; `null`
    deletes, an object merges into an object (or into nothing), anything else replaces."""
    base = dict(existing) if isinstance(existing, dict) else {}
    if not isinstance(update, dict) or not update:
        return base
    for key, value in update.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict):
            base[key] = merge(base.get(key) if isinstance(base.get(key), dict) else None, value)
        else:
            base[key] = value
    return base


def _without_optional_nulls(value: Any, schema: Any) -> Any:
    """Mastra's `stripNullsFromOptional`: a `null` of a property the schema does not require
    is dropped, at every depth (so it never deletes: Mastra's tool drops it before the merge)."""
    schema = schema if isinstance(schema, dict) else {}
    if isinstance(value, list):
        return [_without_optional_nulls(item, schema.get("items", {})) for item in value]
    if isinstance(value, dict):
        properties, required = schema.get("properties") or {}, schema.get("required") or []
        return {k: _without_optional_nulls(v, properties.get(k, {})) for k, v in value.items() if not (v is None and k not in required)}
    return value


def _errors(schema: dict[str, Any], memory: Any) -> list[tuple[tuple[Any, ...], str]]:
    """The draft-07 errors of `memory` (ajv's, as Mastra's JSON Schema adapter runs it): each
    (where, what)."""
    return [(tuple(e.absolute_path), e.message) for e in jsonschema.Draft7Validator(schema).iter_errors(memory)]


def _memory(schema: dict[str, Any], given: Any) -> tuple[Any, list[tuple[tuple[Any, ...], str]]]:
    """The tool's validation of its arguments: `memory` (or the arguments themselves, when
    they have no `memory`), its optional fields' `null`s dropped, against the schema."""
    memory = given["memory"] if isinstance(given, dict) and "memory" in given else given
    memory = _without_optional_nulls(memory, schema)
    return memory, _errors(schema, memory)


def _at(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        if not isinstance(value, dict | list):
            return ...  # no such place: not a null
        value = value.get(str(step)) if isinstance(value, dict) else value[step] if isinstance(step, int) and step < len(value) else None
    return value


def _without_nulls(value: Any, at: set[tuple[Any, ...]] | None, here: tuple[Any, ...] = ()) -> Any:
    """Mastra's `stripNullishValues` (`at` None: every null of an object's fields) or
    `stripNullishValuesAtPaths` (only those at `at`)."""
    if value is None:
        return None
    if isinstance(value, list):
        return [item if item is None and at is None else _without_nulls(item, at, (*here, i)) for i, item in enumerate(value)]
    if isinstance(value, dict):
        return {k: _without_nulls(v, at, (*here, k)) for k, v in value.items() if not (v is None and (at is None or (*here, k) in at))}
    return value


def _validated(schema: dict[str, Any], given: Any) -> tuple[Any, list[str]]:
    """What Mastra's tool framework makes of a call's arguments (`validateToolInput`): missing
    arguments are `{}`; arguments that fail are tried once more without their `null`s (those
    at the failing places, or, with none there, every one); the first failure is the answer."""
    given = {} if given is None else given
    memory, errors = _memory(schema, given)
    if not errors:
        return memory, []
    nulls = {where for where, _ in errors if where and _at(given, where) is None}
    retried, again = _memory(schema, _without_nulls(given, nulls or None))
    if not again:
        return retried, []
    return None, sorted(f"{'.'.join(map(str, where)) or 'root'}: {what}" for where, what in errors)


def update(template: Template, existing: str | None, given: Any) -> Updated | Refused:
    """What the model's call of the tool with arguments `given` does to the stored document
    `existing` (None: never written), as Mastra's `updateWorkingMemoryTool` does it."""
    if template.format == "json":
        memory, errors = _validated(msgspec.json.decode(template.content), given)
        if errors:
            return Refused(errors)
        if memory is None:
            return Updated(None, True, NOTHING_GIVEN)
        try:
            stored = msgspec.json.decode(existing) if existing else None
        except msgspec.DecodeError:
            stored = None
        return Updated(_json(merge(stored, memory)), True)
    if not isinstance(given, dict) or not isinstance(given.get("memory"), str):
        return Refused(["memory: must be string"])
    document = given["memory"]
    if existing:
        flat = lambda text: re.sub(r"\s+", " ", text).strip()  # noqa: E731
        if flat(document) == flat(template.content) and flat(existing) != flat(template.content):
            return Updated(None, False, SKIPPED_EMPTY)
    return Updated(document, True)


def call_bytes(given: Any) -> int:
    """A call's size as its event carries it, what `MAX_CALL_BYTES` bounds: its arguments as
    JSON, as msgspec writes them (the model's own text may be shorter: `1E9` is written
    `1000000000.0`). Raises ValueError for what JSON cannot carry (a lone surrogate)."""
    return len(msgspec.json.encode(given))


def fold(template: Template, calls: list[Any], document: str | None = None) -> str | None:
    """The document `calls` (each a call's arguments, in order) make of `document` (from none):
    each applied with `update`, a refused one changing nothing."""
    for given in calls:
        done = update(template, document, given)
        if isinstance(done, Updated) and done.document is not None:
            document = done.document
    return document


def system_message(template: Template, document: str | None) -> dict[str, Any]:
    """The instruction for the document, as a system message of a filtered input's context."""
    return {"role": "system", "content": {"format": 2, "parts": [{"type": "text", "text": instruction(template, document)}]}}


def tool(template: Template) -> dict[str, Any]:
    """`updateWorkingMemory` as a chat-completions function: Mastra's description and its
    input schema (a `memory` string, or the template's JSON Schema as `memory`)."""
    if template.format == "json":
        schema = _closed({k: v for k, v in msgspec.json.decode(template.content).items() if k != "$schema"})
        description = (
            "Update the working memory with new information. Data is merged with existing memory - only include fields you want to add or update. "
            "To preserve existing data, omit the field entirely. Arrays are replaced entirely when provided, so pass the complete array or omit it to keep the existing values."
        )
        parameters = {
            "$schema": DRAFT_07,
            "type": "object",
            "description": "The JSON formatted working memory content to store.",
            "properties": {"memory": schema},
            "required": ["memory"],
        }
        return {"name": TOOL, "description": description, "parameters": parameters}
    memory = {"type": "string", "description": "The Markdown formatted working memory content to store. This MUST be a string. Never pass an object."}
    return {
        "name": TOOL,
        "description": "Update the working memory with new information. Any data not included will be overwritten. Always pass data as string to the memory field. Never pass an object.",
        "parameters": {"$schema": DRAFT_07, "type": "object", "properties": {"memory": memory}, "required": ["memory"]},
    }


def _closed(schema: Any) -> Any:
    """The schema as Mastra offers it to the model (its JSON Schema of the input): every object
    with properties closed to others (`additionalProperties: false`, where it says nothing)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "definitions", "$defs") and isinstance(value, dict):
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        elif key in ("default", "enum", "const", "examples"):  # values, not schemas
            out[key] = value
        else:
            out[key] = _closed(value)
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def output(done: Updated) -> dict[str, Any]:
    """What the tool answers the model for a call that was not refused (Mastra's result)."""
    return {"success": done.success} | ({"message": done.message} if done.message is not None else {})
