// The AI SDK's own client (the `ai` package: `AbstractChat`, the logic `useChat` runs, over
// `DefaultChatTransport`) against `memfilter gateway` on the real stack: a worker, the echo
// agent runner and Kafka behind it. Run by tests/kafka/test_gateway.py, which starts them and
// passes GATEWAY_URL and JWT_KEY (the gateway's HS256 secret).
import { test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { DefaultChatTransport, lastAssistantMessageIsCompleteWithToolCalls } from "ai";
import { Chat as AnyChat, stored as storedOn, text, token } from "./client.mjs";

const GATEWAY = process.env.GATEWAY_URL;
const SECOND = process.env.JWT_2_URL; // another gateway on the same topics and Redis
const UNSERVED = process.env.UNSERVED_URL; // a gateway on topics no worker reads: 5 s for a decision, one request at once
const RUN = randomUUID().slice(0, 8);

class Chat extends AnyChat {
  constructor({ gateway = GATEWAY, ...init }) {
    super({ gateway, ...init });
  }
}

const stored = (chatId, user) => storedOn(GATEWAY, chatId, user);

async function post(body, headers = {}) {
  const r = await fetch(`${GATEWAY}/api/chat`, { method: "POST", headers: { "content-type": "application/json", ...headers }, body: JSON.stringify(body) });
  return { status: r.status, body: r.headers.get("content-type")?.includes("json") ? await r.json() : await r.text() };
}

// A rejection reaches the client as the chat's error: the gateway's JSON body is its message.
function rejection(chat) {
  assert.equal(chat.status, "error", `expected a rejection, got ${chat.status}`);
  return JSON.parse(chat.error.message).error;
}

test("a message gets the agent's answer, with the stored id, and a reload shows the stored conversation", async () => {
  const chat = new Chat({ id: `send-${RUN}`, user: `alice-${RUN}` });
  await chat.sendMessage({ text: "hello there" });
  assert.equal(chat.status, "ready", chat.error?.message);
  const [question, answer] = chat.messages;
  assert.equal(answer.role, "assistant");
  assert.equal(text(answer), "echo: hello there");
  const { status, body } = await stored(chat.id, `alice-${RUN}`);
  assert.equal(status, 200);
  assert.deepEqual(body.map((m) => [m.id, m.role, text(m)]), [[question.id, "user", "hello there"], [answer.id, "assistant", "echo: hello there"]]);
});

test("a client tool call reaches onToolCall, its output goes back and the model's answer follows", async () => {
  const calls = [];
  const chat = new Chat({
    id: `tool-${RUN}`,
    user: `alice-${RUN}`,
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithToolCalls,
    onToolCall: async ({ toolCall }) => {
      calls.push(toolCall);
      chat.addToolOutput({ tool: toolCall.toolName, toolCallId: toolCall.toolCallId, output: { celsius: 21 } });
    },
  });
  await chat.sendMessage({ text: '/tool weather {"city": "Oslo"}' });
  for (let i = 0; i < 100 && !chat.messages.some((m) => text(m).startsWith("weather returned")); i++) {
    await new Promise((r) => setTimeout(r, 100));
  }
  assert.equal(chat.status, "ready", chat.error?.message);
  assert.deepEqual(calls.map((c) => [c.toolName, c.input]), [["weather", { city: "Oslo" }]]);
  const last = chat.messages.at(-1);
  assert.equal(text(last), 'weather returned {"celsius": 21}');
  const { body } = await stored(chat.id, `alice-${RUN}`);
  const call = body.flatMap((m) => m.parts).find((p) => p.type === "tool-weather");
  assert.deepEqual([call.state, call.input, call.output], ["output-available", { city: "Oslo" }, { celsius: 21 }]);
  assert.equal(text(body.at(-1)), 'weather returned {"celsius": 21}');
});

test("regenerate replaces the last answer, and an edit replaces the message and what followed it", async () => {
  const user = `alice-${RUN}`;
  const chat = new Chat({ id: `redo-${RUN}`, user });
  await chat.sendMessage({ text: "first" });
  await chat.sendMessage({ text: "second" });
  const before = (await stored(chat.id, user)).body;
  await chat.regenerate();
  assert.equal(chat.status, "ready", chat.error?.message);
  const regenerated = (await stored(chat.id, user)).body;
  assert.equal(regenerated.length, 4);
  assert.notEqual(regenerated[3].id, before[3].id);
  assert.deepEqual(chat.messages.map((m) => m.id), regenerated.map((m) => m.id));

  const firstId = chat.messages[0].id;
  await chat.sendMessage({ text: "first, edited", messageId: firstId });
  assert.equal(chat.status, "ready", chat.error?.message);
  const edited = (await stored(chat.id, user)).body;
  assert.deepEqual(edited.map((m) => [m.role, text(m)]), [["user", "first, edited"], ["assistant", "echo: first, edited"]]);
  assert.equal(edited[0].id, firstId);
  assert.deepEqual(chat.messages.map((m) => m.id), edited.map((m) => m.id));
});

test("another user's thread is refused (ownership) and left as it was", async () => {
  const owner = new Chat({ id: `two-${RUN}`, user: `alice-${RUN}` });
  await owner.sendMessage({ text: "mine" });
  const before = (await stored(owner.id, `alice-${RUN}`)).body;
  const intruder = new Chat({ id: `two-${RUN}`, user: `mallory-${RUN}` });
  await intruder.sendMessage({ text: "let me in" });
  const error = rejection(intruder);
  assert.equal(error.code, "ownership");
  assert.equal((await stored(owner.id, `mallory-${RUN}`)).status, 403);
  assert.deepEqual((await stored(owner.id, `alice-${RUN}`)).body, before);
});

test("a message id of another thread is refused (foreign-message-id)", async () => {
  const first = new Chat({ id: `ids-a-${RUN}`, user: `alice-${RUN}` });
  await first.sendMessage({ text: "an id of mine" });
  const taken = first.messages[0].id;
  const second = new Chat({ id: `ids-b-${RUN}`, user: `alice-${RUN}` });
  await second.sendMessage({ id: taken, role: "user", parts: [{ type: "text", text: "copied" }] });
  assert.equal(rejection(second).code, "foreign-message-id");
  assert.deepEqual((await stored(second.id, `alice-${RUN}`)).body, []);
});

test("a malformed message is refused (schema) naming where it is wrong, and nothing is stored", async () => {
  const chatId = `schema-${RUN}`;
  const r = await post({ id: chatId, messages: [{ id: "m1", role: "user", parts: [{ type: "tool-x", toolCallId: "c1", state: "done" }] }] }, { Authorization: `Bearer ${token(`alice-${RUN}`)}` });
  assert.equal(r.status, 400);
  assert.equal(r.body.error.code, "schema");
  assert.match(r.body.error.message, /messages\[0\]\.parts\[0\]\.state/);
  assert.deepEqual((await stored(chatId, `alice-${RUN}`)).body, []);
});

test("a request over the size limit is refused (too-large)", async () => {
  const chat = new Chat({ id: `big-${RUN}`, user: `alice-${RUN}` });
  await chat.sendMessage({ text: "x".repeat(1_100_000) });
  assert.equal(rejection(chat).code, "too-large");
});

test("a retry with the same Idempotency-Key is a duplicate naming the original, and changes nothing", async () => {
  const headers = { "Idempotency-Key": `retry-${RUN}` };
  const chat = new Chat({ id: `retry-${RUN}`, user: `alice-${RUN}`, headers });
  await chat.sendMessage({ text: "once" });
  assert.equal(chat.status, "ready", chat.error?.message);
  const before = (await stored(chat.id, `alice-${RUN}`)).body;
  const again = new Chat({ id: `retry-${RUN}`, user: `alice-${RUN}`, headers });
  await again.sendMessage({ text: "once more" });
  const error = rejection(again);
  assert.equal(error.code, "duplicate");
  assert.match(error.message, new RegExp(`retry-${RUN}`));
  assert.deepEqual((await stored(chat.id, `alice-${RUN}`)).body, before);
});

test("missing, forged and expired tokens and a body naming another resource are refused before anything is published", async () => {
  const chatId = `auth-${RUN}`;
  const body = { id: chatId, messages: [{ id: `auth-m-${RUN}`, role: "user", parts: [{ type: "text", text: "hi" }] }] };
  for (const [headers, code, status] of [
    [{}, "unauthenticated", 401],
    [{ Authorization: `Bearer ${token(`alice-${RUN}`, { key: "not the gateway's key" })}` }, "unauthenticated", 401],
    [{ Authorization: `Bearer ${token(`alice-${RUN}`, { expiresIn: -60 })}` }, "unauthenticated", 401],
  ]) {
    const r = await post(body, headers);
    assert.deepEqual([r.status, r.body.error.code], [status, code]);
  }
  const r = await post({ ...body, resourceId: `bob-${RUN}` }, { Authorization: `Bearer ${token(`alice-${RUN}`)}` });
  assert.deepEqual([r.status, r.body.error.code], [403, "ownership"]);
  assert.deepEqual((await stored(chatId, `alice-${RUN}`)).body, []);
});

test("a request that asks for no answer gets an empty stream, and what it brought is stored", async () => {
  const user = `alice-${RUN}`;
  const chatId = `quiet-${RUN}`;
  const transport = new DefaultChatTransport({ api: `${GATEWAY}/api/chat`, headers: { Authorization: `Bearer ${token(user)}` } });
  const messages = [
    { id: `quiet-u-${RUN}`, role: "user", parts: [{ type: "text", text: "hi" }] },
    { id: `quiet-a-${RUN}`, role: "assistant", parts: [{ type: "text", text: "hello, from before" }] },
  ];
  const stream = await transport.sendMessages({ chatId, messages, trigger: "submit-message", messageId: undefined, abortSignal: undefined });
  const chunks = [];
  for await (const chunk of stream) chunks.push(chunk);
  assert.deepEqual(chunks.filter((c) => !["start", "finish", "start-step", "finish-step"].includes(c.type)), []);
  const { body } = await stored(chatId, user);
  assert.deepEqual(body.map((m) => [m.id, m.role, text(m)]), messages.map((m) => [m.id, m.role, text(m)]));
});

test("a conversation goes on through another gateway: no instance holds anything of it", async () => {
  const user = `alice-${RUN}`;
  const first = new Chat({ id: `across-${RUN}`, user });
  await first.sendMessage({ text: "one" });
  assert.equal(first.status, "ready", first.error?.message);
  const second = new Chat({ id: first.id, user, gateway: SECOND, messages: first.messages });
  await second.sendMessage({ text: "two" });
  assert.equal(second.status, "ready", second.error?.message);
  const { body } = await stored(first.id, user);
  assert.deepEqual(body.map((m) => text(m)), ["one", "echo: one", "two", "echo: two"]);
  assert.deepEqual(second.messages.map((m) => m.id), body.map((m) => m.id));
});

test("with no worker behind it, a request times out saying what it waited for, and one past the in-flight bound is refused", async () => {
  const user = `alice-${RUN}`;
  const waiting = new Chat({ id: `unserved-a-${RUN}`, user, gateway: UNSERVED });
  const sent = waiting.sendMessage({ text: "anyone there?" });
  for (let i = 0; i < 100 && !(await (await fetch(`${UNSERVED}/metrics`)).text()).includes("memfilter_gateway_in_flight 1.0"); i++) {
    await new Promise((r) => setTimeout(r, 20)); // until it waits for a decision (5 s at most)
  }
  const more = new Chat({ id: `unserved-b-${RUN}`, user, gateway: UNSERVED });
  await more.sendMessage({ text: "me too" });
  assert.equal(rejection(more).code, "busy");
  await sent;
  const timeout = rejection(waiting);
  assert.equal(timeout.code, "timeout");
  assert.match(timeout.message, /^no decision on request \S+ within 5 s \(MEMFILTER_GATEWAY_OUTCOME_S\): is a worker running on chat-requests-/);
});
