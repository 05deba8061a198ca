"""Tokens of a message, as the model's context budget counts them (MEMFILTER_CONTEXT_TOKENS).

Why: the model limits its input in tokens, not rows (one tool result can be 200 KB). The
window of the model's `context` (`memfilter.core.window`) is the most recent history that fits
a budget; this module says what each message costs.

Two counters, by MEMFILTER_TOKEN_COUNTER:

- `estimate` (the default) counts exactly as Mastra's `TokenLimiterProcessor` does in
  `@mastra/core` 1.71.0 (`countInputMessageTokens`, `countCoreSystemMessageTokens`): the
  `tokenx` 1.3.0 heuristic (`estimateTokenCount`, bundled in that release and ported below) of
  one string made of the role and, part by part, a text part's text, a pending tool call's name
  and arguments, a tool result, and any other part as JSON; 3.8 tokens per message and per tool
  result, 12 less for each value written as JSON, media estimated apart (765 per image, a
  quarter token per byte of other data, 258 when its size is unknown); 24 per conversation.
  The same float arithmetic in the same order, so a budget's boundary falls where Mastra's does.
- `o200k` counts the same pieces exactly with OpenAI's o200k_base encoding (GPT-4o, o-series,
  GPT-5), offline, from the `bpe-openai` package (`pip install 'memfilter[tokens]'`): each
  piece encoded on its own, 3 tokens per message and per tool result and 3 per conversation
  (OpenAI's chat format: `<|im_start|>`, `<|im_sep|>`, `<|im_end|>`; a tool result is a
  message of its own; the reply is primed with 3), media as above.

A count is a float (the estimate's 3.8), the same for the same message bytes everywhere: the
writers store it with the row when they save it (`stored_count`), so a decision counts only
what is new. Pure functions; the encoding is loaded once, on first use.
"""

from __future__ import annotations

import functools
import math
import re
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

Msg = dict[str, Any]

# ---- tokenx 1.3.0, `estimateTokenCount` (as bundled by @mastra/core 1.71.0) ----------------
# JavaScript's `\s` (Python's differs: \x1c-\x1f and \x85 are space there, \ufeff is not).
_WS = "\t\n\x0b\x0c\r \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff"
_PUNCT = r"[.,!?;(){}\[\]<>:/\\|@#$%^&*+=`~_-]"
_SPLIT = re.compile(f"([{_WS}]+|{_PUNCT}+)")
_WHITESPACE = re.compile(f"[{_WS}]+")
_CJK = re.compile(
    "[\u4e00-\u9fff\u3400-\u4dbf\u3000-\u303f\uff00-\uffef\u30a0-\u30ff\u2e80-\u2eff\u31c0-\u31ef\u3200-\u32ff"
    "\u3300-\u33ff\uac00-\ud7af\u1100-\u11ff\u3130-\u318f\ua960-\ua97f\ud7b0-\ud7ff]"
)
_LANGUAGES = (  # (pattern, average characters per token), the first that matches wins
    (re.compile("[äöüßẞ]", re.IGNORECASE), 3),
    (re.compile("[éèêëàâîïôûùüÿçœæáíóúñ]", re.IGNORECASE), 3),
    (re.compile("[ąćęłńóśźżěščřžýůúďťň]", re.IGNORECASE), 3.5),
)
_DEFAULT_CHARS_PER_TOKEN = 6


def estimate(text: str) -> int:
    """tokenx's `estimateTokenCount`: the text split at runs of whitespace and of punctuation,
    each segment estimated by what it is."""
    if not text:
        return 0
    if text.isascii():
        return _ascii(text)
    return sum(_segment(s) for s in _SPLIT.split(text) if s)


# An ASCII text, the same rules in bulk: a word (neither whitespace nor punctuation: the split
# leaves no other kind) is 1 token if it is digits, else one per 6 characters, rounded up (so 1
# up to 3 characters too); a punctuation run is 1 up to 3 characters, else one per 2; whitespace
# 0. Words and runs come from `str.split` on the text with the other kinds made spaces (\x1c-\x1f,
# spaces to Python, are word characters to JavaScript): twice as fast as a regex.
_PUNCTUATION_CHARS = frozenset(".,!?;(){}[]<>:/\\|@#$%^&*+=`~_-")
_WORDS = str.maketrans({**dict.fromkeys(_PUNCTUATION_CHARS, " "), **dict.fromkeys("\x1c\x1d\x1e\x1f", "a")})
_RUNS = str.maketrans({c: " " for c in map(chr, range(128)) if c not in _PUNCTUATION_CHARS})


def _ascii(text: str) -> int:
    n = 0
    for word in text.translate(_WORDS).split():
        n += 1 if word.isdigit() else (len(word) + 5) // 6
    for run in text.translate(_RUNS).split():
        n += 1 if len(run) <= 3 else (len(run) + 1) // 2
    return n


_WHITESPACE_CHARS = frozenset(c for c in map(chr, range(0x3001)) if _WHITESPACE.fullmatch(c)) | {"\ufeff"}


def _segment(s: str) -> int:
    """One segment of the split: a run of whitespace, a run of punctuation, or a word with neither."""
    first = s[0]
    if first in _WHITESPACE_CHARS:
        return 0
    if first in _PUNCTUATION_CHARS:
        return 1 if len(s) <= 3 else (len(s) + 1) // 2
    if s.isascii():
        return 1 if s.isdigit() else (len(s) + 5) // 6
    if _CJK.search(s):
        return len(s)  # code points (JavaScript's `Array.from(text).length`)
    length = len(s.encode("utf-16-le", "surrogatepass")) // 2  # JavaScript's `length`
    if length <= 3:
        return 1
    per = next((chars for pattern, chars in _LANGUAGES if pattern.search(s)), _DEFAULT_CHARS_PER_TOKEN)
    return math.ceil(length / per)


# ---- what a message is made of -----------------------------------------------------------

TOKENS_PER_IMAGE = 765
TOKENS_PER_MEDIA_FALLBACK = 258
BYTES_PER_TOKEN = 4
_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*:", re.IGNORECASE)


class Pieces(msgspec.Struct, gc=False):
    """What a message is counted from (Mastra's `countInputMessageTokens`, part by part)."""

    text: list[str]  # the role, then each counted part's text, in order
    json: int = 0  # of them, values written as JSON
    results: int = 0  # tool results (each a message of its own to the model)
    media: int = 0  # the media's estimate


def pieces(m: Msg) -> Pieces:
    """The pieces of a stored (Mastra format 2) message."""
    out = Pieces([str(m.get("role"))])
    content = m.get("content")
    if isinstance(content, str):
        out.text.append(content)
        return out
    if not isinstance(content, dict):
        return out
    parts = content.get("parts")
    if not isinstance(parts, list):
        if _truthy(content.get("content")):
            out.text.append(str(content["content"]))
        return out
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            out.text.append(str(part.get("text", "")))
        elif kind == "tool-invocation":
            _invocation(part.get("toolInvocation") or {}, out)
        elif kind == "file":
            out.media += _media(_either(part, "data", "url"), _either(part, "mimeType", "mediaType"))
        else:
            out.text.append(_json(part))
    return out


def _invocation(inv: Msg, out: Pieces) -> None:
    state = inv.get("state")
    if state in ("call", "partial-call"):
        if _truthy(inv.get("toolName")):
            out.text.append(str(inv["toolName"]))
        args = inv.get("args")
        if _truthy(args):
            out.text.append(args if isinstance(args, str) else _json(args))
            out.json += not isinstance(args, str)
    elif state == "result":
        out.results += 1
        result = inv.get("result", _NONE)
        if result is _NONE:
            return
        if isinstance(result, str):
            out.text.append(result)
            return
        media = [result] if _is_media(result) else result if isinstance(result, list) and result and all(map(_is_media, result)) else None
        if media is None:
            out.text.append(_json(result))
        else:
            for entry in media:
                out.media += _media(entry["data"], _either(entry, "mediaType", "mimeType"))
                out.text.append(_json({k: v for k, v in entry.items() if k != "data"}))
        out.json += 1


_NONE = object()


def _truthy(value: Any) -> bool:
    """JavaScript's truthiness (an empty object or list is true there)."""
    return value is not None and value is not False and value != 0 and value != "" if not isinstance(value, (dict, list)) else True


def _either(d: Msg, first: str, then: str) -> Any:
    """JavaScript's `d[first] ?? d[then]`."""
    value = d.get(first)
    return value if value is not None else d.get(then)


def _is_media(value: Any) -> bool:
    return (
        isinstance(value, dict) and isinstance(value.get("data"), str) and (isinstance(value.get("mediaType"), str) or isinstance(value.get("mimeType"), str))
    )


def _media(data: Any, media_type: Any) -> int:
    """Mastra's `estimateMediaTokens`: a near-flat cost per image, else by decoded size."""
    if isinstance(media_type, str) and media_type.startswith("image/"):
        return TOKENS_PER_IMAGE
    if not isinstance(data, str):
        return TOKENS_PER_MEDIA_FALLBACK
    if data.startswith("data:"):
        comma = data.find(",")
        base64 = data if comma == -1 else data[comma + 1 :]
    elif _SCHEME.match(data):
        return TOKENS_PER_MEDIA_FALLBACK  # a URL: its size is unknown
    else:
        base64 = data
    return max(1, (len(base64) * 3 // 4) // BYTES_PER_TOKEN)


def _json(value: Any) -> str:
    return msgspec.json.encode(value).decode()  # JSON.stringify's form: compact, key order kept


# ---- the counters ------------------------------------------------------------------------


class Counter(msgspec.Struct, frozen=True):
    """How messages are counted (MEMFILTER_TOKEN_COUNTER): `message` and `system` count one
    message; `conversation` is the cost of a context whatever it holds."""

    name: str
    tag: str  # marks its counts where they are stored (`stored_count`)
    conversation: float

    def message(self, m: Msg) -> float:
        p = pieces(m)
        if self.name == "estimate":  # Mastra's arithmetic, in Mastra's order
            overhead = 0.0
            for _ in range(p.json):
                overhead -= 12
            overhead += 3.8
            if p.results > 0:
                overhead += p.results * 3.8
            return estimate("".join(p.text)) + overhead + p.media
        count = _o200k()
        return sum(count(t) for t in p.text) + 3 * (1 + p.results) + p.media

    def system(self, m: Msg) -> float:
        """A system message, as Mastra counts a system message: its role and text."""
        content = m.get("content")
        if isinstance(content, dict):
            parts = content.get("parts")
            text = "".join(p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "text") if isinstance(parts, list) else ""
            text = text or str(content.get("content") or "")
        else:
            text = str(content or "")
        if self.name == "estimate":
            return estimate("system" + text) + 3.8
        count = _o200k()
        return count("system") + count(text) + 3

    def row(self, raw: bytes) -> float:
        """A stored row's count, from its bytes."""
        return self.message(msgspec.json.decode(raw))


ESTIMATE = Counter("estimate", "e", 24)
O200K = Counter("o200k", "o", 3)
COUNTERS = {c.name: c for c in (ESTIMATE, O200K)}


class MissingEncoding(Exception):
    """The o200k counter without its package."""


@functools.cache
def _o200k() -> Callable[[str], int]:
    # bpe-openai 0.1.4 reads its data with a deprecated importlib.resources call, on import and on first use.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import bpe_openai
        except ImportError:
            raise MissingEncoding("MEMFILTER_TOKEN_COUNTER=o200k needs the bpe-openai package: pip install 'memfilter[tokens]'") from None
        encoding = bpe_openai.get_encoding("o200k_base")
        encoding.encode_ordinary("loaded")
    return lambda text: len(encoding.encode_ordinary(text)) if text else 0


def stored_count(counter: Counter, count: float) -> str:
    """A count as the store keeps it beside its row: the counter's tag and the float, exact."""
    return f"{counter.tag}{count!r}"


def read_counts(counter: Counter, ids: Sequence[str], stored: Sequence[bytes | None]) -> dict[str, float]:
    """The stored counts (`stored_count`) of these ids that are this counter's, by id."""
    tag = counter.tag.encode()
    return {mid: float(raw[1:]) for mid, raw in zip(ids, stored) if raw and raw[:1] == tag}
