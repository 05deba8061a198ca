// Mastra's semantic recall, from @mastra/core 1.71.0 itself: its SemanticRecall processor over
// an InMemoryStore holding the given threads, with a vector index that answers the given scored
// matches (best first, its `topK` of them, within the resource or the thread as Mastra's filter
// asks) and a fake embedder; the question each search is made with is recorded. tests/unit/test_recall.py
// sends one JSON document on standard input:
//   {cases: [{threads: {threadId: [stored message]}, context: [stored message], input: stored message,
//             matches: [{message_id, thread_id, score}], topK, before, after, threshold, scope, thread}]}
// and reads back, for each case: the question embedded, the ids of the model's history after
// recall (in its order), the system messages recall added, and the text of each message of the
// context and the input that saving it would embed (null: none).
import { MessageList } from '@mastra/core/agent';
import { SemanticRecall } from '@mastra/core/processors';
import { RequestContext } from '@mastra/core/request-context';
import { InMemoryStore } from '@mastra/core/storage';

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const input = JSON.parse(Buffer.concat(chunks).toString('utf8'));
const dated = (m) => ({ ...m, createdAt: new Date(m.createdAt) });

async function run(c) {
  const store = new InMemoryStore();
  const memory = await store.getStore('memory');
  const at = new Date('2026-01-01T00:00:00Z');
  for (const threadId of Object.keys(c.threads)) {
    await memory.saveThread({ thread: { id: threadId, resourceId: 'r1', title: '', createdAt: at, updatedAt: at, metadata: {} } });
    await memory.saveMessages({ messages: c.threads[threadId].map(dated) });
  }
  const asked = [];
  const vector = {
    createIndex: async () => {},
    query: async ({ topK, filter }) =>
      c.matches
        .filter((m) => (filter.thread_id ? m.thread_id === filter.thread_id : true))
        .slice(0, topK)
        .map((m, i) => ({ id: `v${i}`, score: m.score, metadata: { message_id: m.message_id, thread_id: m.thread_id } })),
  };
  const embedder = { modelId: 'fake', doEmbed: async ({ values }) => ({ embeddings: values.map(() => [1, 0, 0]) }) };
  const options = { storage: memory, vector, embedder, topK: c.topK, messageRange: { before: c.before, after: c.after }, scope: c.scope };
  const recall = new SemanticRecall(c.threshold === null ? options : { ...options, threshold: c.threshold });
  const search = recall.performSemanticSearch.bind(recall); // the question it searches with (its embeddings are cached across cases)
  recall.performSemanticSearch = (args) => (asked.push(args.query), search(args));
  const list = new MessageList({ threadId: c.thread, resourceId: 'r1' });
  list.add(c.context.map(dated), 'memory');
  list.add([dated(c.input)], 'input');
  const context = new RequestContext();
  context.set('MastraMemory', { thread: { id: c.thread }, resourceId: 'r1' });
  await recall.processInput({ messages: [dated(c.input)], messageList: list, requestContext: context, abort: (why) => { throw new Error(why); } });
  const embedded = [...c.context, c.input].map((m) => (m.role === 'system' ? null : recall.extractTextContent(m) || null));
  return {
    question: asked[0] ?? null,
    embedded,
    history: list.get.all.db().map((m) => m.id),
    system: list.getSystemMessages('memory').map((m) => m.content),
  };
}

const out = [];
for (const c of input.cases) out.push(await run(c));
process.stdout.write(JSON.stringify(out));
