// Exports made by the libraries teams run, for `memfilter history import`
// (tests/kafka/test_import_and_forget.py, tests/kafka/test_working_memory_end_to_end.py). Reads on standard input
//   {threads: [{id, resourceId, title, messages: [Mastra DB message]}], workingMemory: {resourceId: document}}
// saves them with Mastra's own storage (@mastra/core 1.71.0, InMemoryStore: the rows its SQL
// stores keep, one per table row; a resource's working memory as Mastra's memory writes it,
// `updateResource`), and writes back
//   {mastra: [row of mastra_threads, mastra_messages or mastra_resources], ui: [{threadId, resourceId, messages}]}
// the rows as a storage export gives them, and each thread's messages as Mastra hands them to
// the AI SDK (MessageList's AI SDK v5 UI messages), as a useChat app would hold them: each
// thread's checked by the AI SDK's own validateUIMessages (the `ai` package), as useChat's
// server side checks what it is sent.
import { validateUIMessages } from 'ai';
import { MessageList } from '@mastra/core/agent';
import { InMemoryStore } from '@mastra/core/storage';

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const input = JSON.parse(Buffer.concat(chunks).toString('utf8'));

const memory = new InMemoryStore().stores.memory;
const ui = [];
for (const t of input.threads) {
  const now = new Date('2026-01-05T10:00:00.000Z');
  await memory.saveThread({ thread: { id: t.id, resourceId: t.resourceId, title: t.title, metadata: {}, createdAt: now, updatedAt: now } });
  const saved = t.messages.map((m) => ({ ...m, threadId: t.id, resourceId: t.resourceId, createdAt: new Date(m.createdAt) }));
  await memory.saveMessages({ messages: saved });
  const { messages: listed } = await memory.listMessages({ threadId: t.id });
  const messages = new MessageList({ threadId: t.id, resourceId: t.resourceId }).add(listed, 'memory').get.all.aiV5.ui();
  ui.push({ threadId: t.id, resourceId: t.resourceId, messages: await validateUIMessages({ messages }) });
}
for (const [resourceId, workingMemory] of Object.entries(input.workingMemory ?? {})) {
  await memory.updateResource({ resourceId, workingMemory });
}
const rows = [...memory.db.threads.values(), ...memory.db.messages.values(), ...memory.db.resources.values()];
process.stdout.write(JSON.stringify({ mastra: JSON.parse(JSON.stringify(rows)), ui }));
