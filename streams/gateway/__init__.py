"""`memfilter gateway`: the HTTP backend a `useChat` app talks to, with Kafka and the workers behind it.

- `identity`: who the caller is (a verified JWT's `sub`, or a proxy's header): the resource
  of every request, never the body's;
- `outcomes`: one reader per gateway of what became of each request (its filtered input or
  dead letter) and of the agent's saved reply;
- `server`: the routes (`POST /api/chat`, `GET /api/threads/{id}/messages`, health and
  metrics), on aiohttp.

The answer's wire format is the AI SDK's UI message stream (`memfilter.core.ui_stream`).
"""
