// Replies as they stream, through `memfilter gateway`, with the AI SDK's own client: the agent
// runner behind MODEL_URL calls the fake OpenAI endpoint (tests/fake_openai.py: `slow N` is N
// tokens 0.15 s apart, `call NAME {json}` a tool call, a tool result gets "tool said ...", else
// "model says N" for N messages sent). MODEL_2_URL is another gateway on the same topics.
// Run by tests/kafka/test_gateway.py, after resume.test.mjs.
import { test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { lastAssistantMessageIsCompleteWithToolCalls } from "ai";
import { Chat, answer, kept, stored, text, token, until } from "./client.mjs";

const MODEL = process.env.MODEL_URL;
const MODEL_2 = process.env.MODEL_2_URL;
const RUN = randomUUID().slice(0, 8);

test("tokens reach the client before the reply is saved, and the client's copy is the stored one", async () => {
  const user = `ann-${RUN}`;
  const shown = [];
  const chat = new Chat({ id: `tokens-${RUN}`, user, gateway: MODEL, onChange: (ms) => answer(ms) && shown.push(text(answer(ms))) });
  let storedWhilePartial;
  const sending = chat.sendMessage({ text: "slow 12" });
  await until(() => shown.length, (n) => n > 0 && shown.at(-1).split(" ").length > 2);
  storedWhilePartial = (await stored(MODEL, chat.id, user)).body;
  await sending;
  assert.equal(chat.status, "ready", chat.error?.message);
  const full = Array.from({ length: 12 }, (_, i) => `t${i} `).join("");
  assert.ok(shown.some((t) => t.length > 0 && t.length < full.length), "no partial text was ever shown");
  assert.deepEqual(storedWhilePartial.map((m) => m.role), ["user"]); // tokens shown while nothing was saved yet
  assert.equal(text(chat.messages[1]), full);
  const { body } = await stored(MODEL, chat.id, user);
  assert.deepEqual(body.map(kept), chat.messages.map(kept)); // the saved reply is what the chunks added up to
  assert.deepEqual(body[1].metadata, { model: "m", finishReason: "stop", usage: { inputTokens: 11, outputTokens: 12, totalTokens: 23 } });
});

test("a second tab's message while the first's reply streams is refused busy-thread when it asks so, and goes in after the reply", async () => {
  const user = `dan-${RUN}`;
  const id = `tabs-${RUN}`;
  const first = new Chat({ id, user, gateway: MODEL });
  const sending = first.sendMessage({ text: "slow 10" });
  await until(() => first.messages.length, (n) => n === 2); // the reply is streaming
  const second = new Chat({ id, user, gateway: MODEL_2, messages: (await stored(MODEL_2, id, user)).body });
  await second.sendMessage({ text: "and another thing" }, { body: { concurrentTurns: "reject" } });
  assert.equal(second.status, "error");
  const refused = JSON.parse(second.error.message).error;
  assert.equal(refused.code, "busy-thread");
  assert.match(refused.message, /is answering request .*send it again once that reply ends/);
  await sending;
  assert.equal(first.status, "ready", first.error?.message);
  const again = new Chat({ id, user, gateway: MODEL_2, messages: (await stored(MODEL_2, id, user)).body });
  await again.sendMessage({ text: "and another thing" }, { body: { concurrentTurns: "reject" } });
  assert.equal(again.status, "ready", again.error?.message);
  const { body } = await stored(MODEL, id, user);
  assert.deepEqual(body.map((m) => m.role), ["user", "assistant", "user", "assistant"]);
  assert.equal(text(body[1]), Array.from({ length: 10 }, (_, i) => `t${i} `).join("")); // the first reply, whole, before the second message
});

test("under enqueue, a second tab's message while the first's reply streams waits for it, and its model sees that reply", async () => {
  const user = `eve-${RUN}`;
  const id = `queue-${RUN}`;
  const first = new Chat({ id, user, gateway: MODEL });
  const sending = first.sendMessage({ text: "slow 10" });
  await until(() => first.messages.length, (n) => n === 2); // the reply is streaming
  // the second tab has not seen the reply: it sends its message after the first question alone
  const second = new Chat({ id, user, gateway: MODEL_2, messages: (await stored(MODEL_2, id, user)).body });
  const queued = second.sendMessage({ text: "and another thing" }, { body: { concurrentTurns: "enqueue" } });
  await sending;
  await queued;
  assert.equal(first.status, "ready", first.error?.message);
  assert.equal(second.status, "ready", second.error?.message);
  const { body } = await stored(MODEL, id, user);
  assert.deepEqual(body.map((m) => m.role), ["user", "assistant", "user", "assistant"]);
  assert.equal(text(body[1]), Array.from({ length: 10 }, (_, i) => `t${i} `).join("")); // the first reply, whole, before the second message
  assert.equal(text(body[3]).trim(), "model says 3"); // its model saw the question, the first reply and the new message
  assert.equal(text(second.messages.at(-1)), text(body[3]));
});

test("under interrupt, a second tab's message stops the reply streaming, which is saved interrupted and is in its model's input", async () => {
  const user = `fay-${RUN}`;
  const id = `interrupt-${RUN}`;
  const first = new Chat({ id, user, gateway: MODEL });
  const sending = first.sendMessage({ text: "slow 60" });
  await until(() => first.messages.length, (n) => n === 2 && text(first.messages[1]).length > 0);
  const second = new Chat({ id, user, gateway: MODEL_2, messages: (await stored(MODEL_2, id, user)).body });
  await second.sendMessage({ text: "stop, I meant this" }, { body: { concurrentTurns: "interrupt" } });
  await sending;
  assert.equal(second.status, "ready", second.error?.message);
  const { body } = await stored(MODEL, id, user);
  assert.deepEqual(body.map((m) => m.role), ["user", "assistant", "user", "assistant"]);
  assert.equal(body[1].metadata.finishReason, "interrupted");
  assert.ok(text(body[1]).split(" ").length < 60, `the first reply was not cut: ${text(body[1])}`);
  assert.equal(text(body[3]).trim(), "model says 3");
});

test("another user can neither resume nor stop a reply in a thread not theirs", async () => {
  const chat = new Chat({ id: `mine-${RUN}`, user: `cat-${RUN}`, gateway: MODEL });
  const sending = chat.sendMessage({ text: "slow 8" });
  await until(() => chat.messages.length, (n) => n === 2);
  const as = { Authorization: `Bearer ${token(`mallory-${RUN}`)}` };
  assert.equal((await fetch(`${MODEL_2}/api/chat/${chat.id}/stream`, { headers: as })).status, 403);
  assert.equal((await fetch(`${MODEL_2}/api/chat/${chat.id}/stop`, { method: "POST", headers: as })).status, 403);
  await sending;
  assert.equal(text(chat.messages[1]).split(" ").length, 9); // never stopped: 8 tokens
});

test("a stop saves what was made, marked interrupted, and the next turn's context holds it", async () => {
  const user = `dan-${RUN}`;
  const shown = [];
  const chat = new Chat({ id: `stop-${RUN}`, user, gateway: MODEL, onChange: (ms) => answer(ms) && shown.push(text(answer(ms))) });
  const sending = chat.sendMessage({ text: "slow 40" });
  await until(() => shown.length, (n) => n > 0 && shown.at(-1).split(" ").length > 3);
  const stop = await fetch(`${MODEL}/api/chat/${chat.id}/stop`, { method: "POST", headers: { Authorization: `Bearer ${token(user)}` } });
  assert.equal(stop.status, 202);
  await chat.stop();
  await sending;
  const seen = text(chat.messages[1]);
  const { body } = await until(() => stored(MODEL, chat.id, user), (r) => r.body.length === 2);
  const saved = text(body[1]);
  assert.equal(body[1].metadata.finishReason, "interrupted");
  assert.ok(saved.startsWith(seen) && saved.length < 40 * 4, `saved ${JSON.stringify(saved)}, seen ${JSON.stringify(seen)}`);
  const resume = () => fetch(`${MODEL}/api/chat/${chat.id}/stream`, { headers: { Authorization: `Bearer ${token(user)}` } });
  await until(async () => (await resume()).status, (s) => s === 204); // once saved, nothing to resume

  const next = new Chat({ id: chat.id, user, gateway: MODEL, messages: body });
  await next.sendMessage({ text: "and then?" });
  assert.equal(next.status, "ready", next.error?.message);
  assert.equal(text(next.messages.at(-1)), "model says 3"); // the model was sent the question, the partial reply and this
});

test("a tool call, the client's output and the model's continuation are one stored message, as the client keeps it", async () => {
  const user = `eve-${RUN}`;
  const calls = [];
  const chat = new Chat({
    id: `turn-${RUN}`,
    user,
    gateway: MODEL,
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithToolCalls,
    onToolCall: async ({ toolCall }) => {
      calls.push(toolCall);
      chat.addToolOutput({ tool: toolCall.toolName, toolCallId: toolCall.toolCallId, output: { celsius: 21 } });
    },
  });
  await chat.sendMessage({ text: 'call weather {"city": "Oslo"}' });
  await until(() => text(chat.messages.at(-1)), (t) => t.startsWith("tool said"));
  await until(() => chat.status, (s) => s === "ready");
  assert.deepEqual(calls.map((c) => [c.toolName, c.input]), [["weather", { city: "Oslo" }]]);
  assert.equal(chat.messages.length, 2); // the question, and one answer holding the call, its output and the continuation
  const [, turn] = chat.messages;
  assert.deepEqual(turn.parts.map((p) => p.type), ["step-start", "tool-weather", "step-start", "text"]);
  assert.equal(turn.metadata.finishReason, "stop");
  const { body } = await until(() => stored(MODEL, chat.id, user), (r) => r.body.length === 2 && text(r.body[1]).startsWith("tool said"));
  assert.deepEqual(body.map(kept), chat.messages.map(kept));
});
