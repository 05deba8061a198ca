"""The two formats of a filtered input's `messages`, and the messages whole from either.

What a request contributes (`messages`) is, almost always, also in the model's `context`: a
new message at its end, a stored row the request updates in its place. Format 1 writes each
twice; format 2 (the default, MEMFILTER_FILTERED_FORMAT) writes a message that is in the context
once, there, and in `messages` a JSON Reference to it (`{"$ref": "#/context/7"}`), and marks
the record `"format": 2`. A message the context holds in another form (a row saved without
its streaming tool calls) stays whole. The context is the same in both formats, so a consumer
that reads only the context (an agent runner calling a model) reads either; one that reads
`messages` takes them through `whole_messages` (`whole` for a decoded JSON value, as replay
compares them), or decodes the record with `decode_whole` (the Python client and the agent
runner do).

Pure functions, on the decision's own objects: a message is referenced only where the context
holds that very object.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET

from memfilter.schemas.wire import FilteredInput

FORMAT = 2  # the format `compact` makes

_PREFIX = "#/context/"


class BadReference(msgspec.ValidationError):
    """A reference in `messages` that names no message of the context: a value that is not the
    processor's (a `msgspec.ValidationError`, as any other value that does not match)."""


def compact(messages: list[Any], context: list[Any]) -> list[Any]:
    """`messages` in format 2: each one the context holds, as a reference to it."""
    at = {id(m): j for j, m in enumerate(context)}
    return [{"$ref": f"{_PREFIX}{at[id(m)]}"} if id(m) in at else m for m in messages]


def whole_messages(messages: list[Any], context: list[Any]) -> list[Any]:
    """A filtered input's `messages` whole, from either format (format 1 comes back as it is)."""
    return [_resolved(m, context) if _is_reference(m) else m for m in messages]


def whole(filtered: dict[str, Any]) -> dict[str, Any]:
    """A filtered input's JSON in format 1, from either format: its messages whole, no `format`."""
    one = {k: v for k, v in filtered.items() if k != "format"}
    one["messages"] = whole_messages(filtered["messages"], filtered["context"])
    return one


_DECODER = msgspec.json.Decoder(FilteredInput)


def decode_whole(raw: bytes) -> FilteredInput:
    """A `filtered-inputs` value, its messages whole whichever its format (format 1 on return);
    raises `msgspec.DecodeError` for a value that is not a filtered input."""
    event = _DECODER.decode(raw)
    if event.format is not UNSET:
        event.messages = whole_messages(event.messages, event.context)
        event.format = UNSET
    return event


def _is_reference(m: Any) -> bool:
    return isinstance(m, dict) and len(m) == 1 and "$ref" in m


def _resolved(reference: dict[str, Any], context: list[Any]) -> Any:
    target = reference["$ref"]
    index = target[len(_PREFIX) :] if isinstance(target, str) and target.startswith(_PREFIX) else ""
    if not index.isdigit() or int(index) >= len(context):
        raise BadReference(f"messages hold a reference {target!r} to no message of the context ({len(context)} messages)")
    return context[int(index)]
