// The reference counts and trims for memfilter's context budget, from the libraries users run:
// Mastra's TokenLimiterProcessor (@mastra/core 1.71.0: its tokenx estimate, its per-message
// count, its `contiguous` trim of a MessageList) and gpt-tokenizer's o200k_base (GPT-4o's chat
// encoding). tests/unit/test_context_budget.py sends one JSON document on standard input:
//   {strings: [text], messages: [stored message], chats: [[{role, content}]],
//    threads: [{system: [text], history: [stored message], input: [stored message], limit}]}
// and reads back, in the same order: the estimate of each string, Mastra's count of each
// message, gpt-tokenizer's token count of each chat, and for each thread the ids Mastra keeps
// (or its TripWire's message).
import { MessageList } from '@mastra/core/agent';
import { TokenLimiterProcessor } from '@mastra/core/processors';
import { encodeChat } from 'gpt-tokenizer/model/gpt-4o';

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const input = JSON.parse(Buffer.concat(chunks).toString('utf8'));

const counter = new TokenLimiterProcessor({ limit: 1, trimMode: 'contiguous' });
const dated = (m) => ({ ...m, createdAt: new Date(m.createdAt) });

async function trim({ system, history, input: newMessages, limit }) {
  const list = new MessageList({ threadId: 't1', resourceId: 'r1' });
  list.add(history.map(dated), 'memory');
  list.add(newMessages.map(dated), 'input');
  for (const text of system) list.addSystem(text);
  const limiter = new TokenLimiterProcessor({ limit, trimMode: 'contiguous' });
  try {
    await limiter.processInputStep({ messageList: list, stepNumber: 0, steps: [], abort: (why) => { throw new Error(why); } });
  } catch (e) {
    return { error: e.message };
  }
  return { kept: list.get.all.db().map((m) => m.id) };
}

const out = {
  estimates: (input.strings ?? []).map((s) => counter.countTokens(s)),
  counts: await Promise.all((input.messages ?? []).map((m) => counter.countInputMessageTokens(m))),
  chats: (input.chats ?? []).map((chat) => encodeChat(chat).length),
  threads: [],
};
for (const thread of input.threads ?? []) out.threads.push(await trim(thread));
process.stdout.write(JSON.stringify(out));
