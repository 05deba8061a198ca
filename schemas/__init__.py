"""Wire types of the product's topics (see `wire.py`) and their generated JSON Schemas."""

from memfilter.schemas.wire import (
    ChatRequest,
    ChatRequestOf,
    Dropped,
    FilteredInput,
    Message,
    MessageDict,
    PersistMessages,
    Source,
    json_schemas,
)

__all__ = [
    "ChatRequest",
    "ChatRequestOf",
    "Dropped",
    "FilteredInput",
    "Message",
    "MessageDict",
    "PersistMessages",
    "Source",
    "json_schemas",
]
