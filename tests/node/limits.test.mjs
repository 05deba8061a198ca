// The AI SDK's own client (`AbstractChat` over `DefaultChatTransport`, as `useChat` runs it)
// against a gateway at its default fair limits, a worker and the echo agent runner behind it.
// Run by tests/kafka/test_gateway_limits.py, which starts them and passes GATEWAY_URL and
// RESOURCE_HEADER (the gateway takes the caller from that header).
import { test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { Chat, text } from "./client.mjs";

const GATEWAY = process.env.GATEWAY_URL;
const RUN = randomUUID().slice(0, 8);

test("turns past a user's share are the chat's error (rate-limited, saying when to try again), those within it are answered", async () => {
  const user = `eager-${RUN}`;
  const chats = Array.from({ length: 12 }, (_, n) => new Chat({ id: `eager-${RUN}-${n}`, user, gateway: GATEWAY }));
  await Promise.all(chats.map((chat, n) => chat.sendMessage({ text: `turn ${n}` })));
  const refused = chats.filter((chat) => chat.status === "error");
  const answered = chats.filter((chat) => chat.status === "ready");
  assert.equal(refused.length + answered.length, chats.length);
  assert.ok(refused.length > 0 && answered.length > 0, `${refused.length} refused, ${answered.length} answered`);
  for (const chat of refused) {
    const error = JSON.parse(chat.error.message).error;
    assert.equal(error.code, "rate-limited");
    assert.match(error.message, /try again in \d+ s/);
  }
  for (const chat of answered) assert.equal(text(chat.messages.at(-1)), `echo: ${text(chat.messages[0])}`);
});
