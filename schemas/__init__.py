"""Wire types of the product's topics (see `wire.py`) and their generated JSON Schemas."""

from schemas.wire import (
    ChatRequest,
    Dropped,
    FilteredInput,
    Message,
    MessageDict,
    PersistMessages,
    Source,
    json_schemas,
    validate_messages,
)

__all__ = [
    "ChatRequest",
    "Dropped",
    "FilteredInput",
    "Message",
    "MessageDict",
    "PersistMessages",
    "Source",
    "json_schemas",
    "validate_messages",
]
