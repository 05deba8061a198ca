// A reply resumed on another gateway, through `memfilter gateway`, with the AI SDK's own client
// (the agent runner behind MODEL_URL and MODEL_2_URL calls tests/fake_openai.py: `slow N` is N
// tokens 0.15 s apart). Run alone by tests/kafka/test_gateway.py, which counts the gateways'
// resumes around it (streaming.test.mjs resumes too).
import { test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { Chat, answer, kept, stored, text, token, until } from "./client.mjs";

const MODEL = process.env.MODEL_URL;
const MODEL_2 = process.env.MODEL_2_URL;
const RUN = randomUUID().slice(0, 8);

test("a dropped connection is resumed on another gateway, which replays the reply from its first token to its end", async () => {
  const user = `bob-${RUN}`;
  const shown = [];
  const first = new Chat({ id: `resume-${RUN}`, user, gateway: MODEL, onChange: (ms) => answer(ms) && shown.push(text(answer(ms))) });
  const sending = first.sendMessage({ text: "slow 20" });
  await until(() => shown.length, (n) => n > 0 && shown.at(-1).length > 0);
  await first.stop(); // the client's side of the connection goes; no stop request: the reply goes on
  await sending;
  const question = first.messages[0];
  const partial = text(first.messages[1]);

  // A new page on the other gateway: the stored messages, then the AI SDK's resume.
  const second = new Chat({ id: first.id, user, gateway: MODEL_2, messages: (await stored(MODEL_2, first.id, user)).body });
  assert.deepEqual(second.messages.map((m) => m.id), [question.id]);
  await second.resumeStream();
  assert.equal(second.status, "ready", second.error?.message);
  assert.equal(text(second.messages[1]), Array.from({ length: 20 }, (_, i) => `t${i} `).join(""));
  assert.ok(partial.length > 0 && partial.length < text(second.messages[1]).length, "the first page saw part of the reply only");
  const { body } = await stored(MODEL_2, first.id, user);
  assert.deepEqual(body.map(kept), second.messages.map(kept));
  const after = await fetch(`${MODEL_2}/api/chat/${first.id}/stream`, { headers: { Authorization: `Bearer ${token(user)}` } });
  assert.equal(after.status, 204); // ended and saved: what the AI SDK takes for "nothing to resume"
});
