"""An OpenAI-compatible chat-completions endpoint on loopback, for the agent runner's tests.

It streams as the real API does (server-sent events of `chat.completion.chunk`s, `[DONE]`,
usage last when `stream_options.include_usage` asks), and keeps every body it was sent
(`received`). What it answers depends on the last message's text:

- `refuse`: HTTP 400 (the input is dead-lettered); `flaky`: HTTP 500 the first time;
- `slow N`: N tokens `t0 t1 ...`, one every SLOW_S seconds (to drop, resume or stop mid-reply);
- `call NAME {json}`: a tool call NAME with those arguments, streamed in three pieces;
- `think`: reasoning, then the text "thought";
- `fail`: two tokens, then an error event midway (as the API sends when it fails mid-stream);
- a tool result last: "tool said <its content>";
- else: "model says N" (N the number of messages it got), a word per chunk.

`refuse_key`, while set, answers 401 as for a wrong key.

It embeds too (`POST /embeddings`), deterministically, so that a test knows what is near what:
a text's vector counts its words (lowercased, letters and digits), each word hashed to one of
DIMENSIONS dimensions; texts that share words are near, texts that share none are at right
angles. A text holding `unembeddable` is refused (HTTP 400), as a text too long would be.
"""

from __future__ import annotations

import json
import re
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pipeline import free_port

SLOW_S = 0.15
DIMENSIONS = 256


def embedding(text: str) -> list[float]:
    vector = [0.0] * DIMENSIONS
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        vector[zlib.crc32(word.encode()) % DIMENSIONS] += 1.0
    return vector


def _text(message: dict) -> str:
    content = message.get("content") or ""
    return content if isinstance(content, str) else " ".join(p.get("text", "") for p in content if isinstance(p, dict))


class FakeOpenAI:
    def __init__(self, host: str = "127.0.0.1"):
        self.received: list[dict] = []
        self.embedded: list[str] = []  # every text it was asked to embed
        self.refuse_key = False
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.endswith("/embeddings"):
                    return self.embed(body)
                fake.received.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
                last = body["messages"][-1]
                said = _text(last)
                if fake.refuse_key:
                    return self.answer(401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error"}})
                if said == "refuse":
                    return self.answer(400, {"error": {"message": "context too long", "type": "invalid_request_error"}})
                if said == "flaky" and sum(_text(r["messages"][-1]) == "flaky" for r in fake.received) == 1:
                    return self.answer(500, {"error": {"message": "overloaded", "type": "server_error"}})
                try:
                    self.stream(body, last, said)
                except (BrokenPipeError, ConnectionResetError):  # the runner ended the call (a stop)
                    pass

            def stream(self, body, last, said):
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                model = body["model"]

                def send(delta=None, finish=None, usage=None, error=None):
                    if error is not None:
                        value = {"error": error}
                    else:
                        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
                        value = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": model, "choices": choices}
                        if usage is not None:
                            value["usage"] = usage
                    self.wfile.write(f"data: {json.dumps(value)}\n\n".encode())
                    self.wfile.flush()

                slow, call = re.fullmatch(r"slow (\d+)", said), re.fullmatch(r"call (\w+) (.*)", said, re.DOTALL)
                send({"role": "assistant", "content": ""})
                if last["role"] == "tool":
                    words, finish = ["tool ", "said ", last["content"]], "stop"
                elif slow:
                    words, finish = [f"t{i} " for i in range(int(slow.group(1)))], "stop"
                elif call:
                    args = call.group(2)
                    third = len(args) // 3
                    send({"tool_calls": [{"index": 0, "id": "call_fake1", "type": "function", "function": {"name": call.group(1), "arguments": ""}}]})
                    for piece in (args[:third], args[third : 2 * third], args[2 * third :]):
                        send({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                    words, finish = [], "tool_calls"
                elif said == "think":
                    for piece in ("let me ", "see"):
                        send({"reasoning_content": piece})
                    words, finish = ["thought"], "stop"
                elif said == "fail":
                    send({"content": "half "})
                    send({"content": "way "})
                    send(error={"message": "the server had an error while processing your request", "type": "server_error"})
                    return
                else:
                    words, finish = ["model ", "says ", str(len(body["messages"]))], "stop"
                for word in words:
                    if slow:
                        time.sleep(SLOW_S)
                    send({"content": word})
                send({}, finish=finish)
                if (body.get("stream_options") or {}).get("include_usage"):
                    send(usage={"prompt_tokens": 11, "completion_tokens": len(words), "total_tokens": 11 + len(words)})
                self.wfile.write(b"data: [DONE]\n\n")

            def embed(self, body):
                texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
                fake.embedded += texts
                if any("unembeddable" in text for text in texts):
                    return self.answer(400, {"error": {"message": "input too long", "type": "invalid_request_error"}})
                data = [{"object": "embedding", "index": i, "embedding": embedding(text)} for i, text in enumerate(texts)]
                self.answer(200, {"object": "list", "data": data, "model": body["model"], "usage": {"prompt_tokens": 1, "total_tokens": 1}})

            def answer(self, status, value):
                raw = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer((host, free_port()), Handler)  # `host`: loopback, or the host's side of the containers' network
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://{host}:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
