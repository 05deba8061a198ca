// Mastra's memory loaders through the gateway, with the AI SDK's own client (`AbstractChat` over
// `DefaultChatTransport`, as `useChat` runs it): a fact told in turn 2 (which the model keeps in
// working memory: the fake endpoint calls `updateWorkingMemory` when told to) is long out of the
// context's window by turn 60, and the model is given it all the same, by working memory and
// by semantic recall. Run by tests/kafka/test_recall_end_to_end.py, which starts a worker, the sink, the
// embedder, the agent runner with both loaders against the fake OpenAI endpoint, and a gateway
// with header identity (GATEWAY_URL, RESOURCE_HEADER); it checks what the model was sent, from
// the endpoint's side.
import { test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import { Chat, stored } from "./client.mjs";

const GATEWAY = process.env.GATEWAY_URL;

const FACT = JSON.stringify({ memory: "my favourite colour is turquoise" });

test("a fact told in turn 2 is kept in working memory and recalled in turn 60, and the stored reply says which message and how near", async () => {
  const user = `recall-${randomUUID().slice(0, 8)}`;
  const chat = new Chat({ id: `${user}-chat`, user, gateway: GATEWAY });
  for (let turn = 1; turn < 60; turn++) {
    await chat.sendMessage({ text: turn === 2 ? `call updateWorkingMemory ${FACT}` : `tell me something else, number ${turn}` });
    assert.equal(chat.status, "ready", chat.error?.message);
  }
  const fact = chat.messages[2];
  // the runner answered the model's call itself, and the client shows it as the reply's tool part
  const kept = chat.messages[3].parts.find((p) => p.type === "tool-updateWorkingMemory");
  assert.deepEqual([kept.state, kept.output], ["output-available", { success: true }]);
  await chat.sendMessage({ text: "what is my favourite colour" });
  assert.equal(chat.status, "ready", chat.error?.message);
  const { status, body } = await stored(GATEWAY, chat.id, user);
  assert.equal(status, 200);
  assert.equal(body.length, 120);
  const recall = body.at(-1).metadata.recall;
  assert.equal(recall.scope, "resource");
  assert.equal(recall.matches[0].id, fact.id);
  assert.ok(recall.matches[0].score > 0.5, JSON.stringify(recall));
  assert.ok(recall.messages.includes(fact.id));
});
