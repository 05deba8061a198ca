// The same chat turns as benchmarks/turn_cost.py, through Mastra 1.71's in-process agent: an
// `Agent` with `Memory` (`lastMessages: 10`, LibSQL file storage) and a mock model that streams
// the echo runner's answer ("echo: " and the user's last text, a word per text delta) at once.
// One Node process, no HTTP: the peer a team would otherwise pick, at its cheapest.
//
// Each turn sends the thread's messages as `useChat` holds them (its replies included; the
// first turn with `--history` messages before it), open-loop at `--rate` a second, a thread's
// next turn once its reply ended. The process idles `--idle-s` seconds first, measured. Prints
// one JSON line: seconds to the first text delta and to the end of each turn, and the process's
// CPU seconds a second idle and per turn (the idle taken out), as turn_cost.py reads them.
//
//   node benchmarks/mastra/turns.mjs --rate 20 --turns 400 --threads 20 --history 10 --db /tmp/x.db
import { parseArgs } from "node:util";
import { Agent } from "@mastra/core/agent";
import { LibSQLStore } from "@mastra/libsql";
import { Memory } from "@mastra/memory";
import { simulateReadableStream } from "ai";
import { MockLanguageModelV3 } from "ai/test";

const { values: opt } = parseArgs({
  options: {
    rate: { type: "string", default: "5" },
    turns: { type: "string", default: "150" },
    threads: { type: "string", default: "20" },
    history: { type: "string", default: "0" },
    "idle-s": { type: "string", default: "5" },
    db: { type: "string" },
  },
});
const [rate, turns, threadCount, history, idleS] = ["rate", "turns", "threads", "history", "idle-s"].map((k) => Number(opt[k]));

const words = (text) => text.match(/\S+\s*|\s+/g) ?? [""];
const model = new MockLanguageModelV3({
  doStream: async ({ prompt }) => {
    const last = prompt.filter((m) => m.role === "user").at(-1);
    const text = `echo: ${(last?.content ?? []).filter((p) => p.type === "text").map((p) => p.text).join("")}`;
    const chunks = [
      { type: "stream-start", warnings: [] },
      { type: "text-start", id: "t" },
      ...words(text).map((delta) => ({ type: "text-delta", id: "t", delta })),
      { type: "text-end", id: "t" },
      { type: "finish", finishReason: { unified: "stop", raw: "stop" }, usage: { inputTokens: { total: 10 }, outputTokens: { total: 5 } } },
    ];
    return { stream: simulateReadableStream({ chunks }) };
  },
});
const memory = new Memory({ storage: new LibSQLStore({ id: "turns", url: `file:${opt.db}` }), options: { lastMessages: 10 } });
const agent = new Agent({ id: "echo", name: "echo", instructions: "", model, memory });
const run = Math.random().toString(36).slice(2, 10);

class Thread {
  constructor(n) {
    this.chat = `turn-${run}-${n}`;
    this.user = `user-${n}`;
    this.turns = 0;
    this.busy = Promise.resolve();
    this.messages = Array.from({ length: history }, (_, i) => ({
      id: `${this.chat}-h${i}`,
      role: i % 2 ? "assistant" : "user",
      parts: [{ type: "text", text: i % 2 ? `echo: earlier ${i - 1}` : `earlier ${i}` }],
    }));
  }

  turn() {
    const done = this.busy.then(() => this.#turn());
    this.busy = done.catch(() => {});
    return done;
  }

  async #turn() {
    this.turns += 1;
    this.messages.push({ id: `${this.chat}-u${this.turns}`, role: "user", parts: [{ type: "text", text: `turn ${this.turns}: and then?` }] });
    const started = performance.now();
    let first;
    let text = "";
    const out = await agent.stream(this.messages, { memory: { thread: this.chat, resource: this.user } });
    for await (const chunk of out.fullStream) {
      if (chunk.type === "text-delta") {
        first ??= performance.now() - started;
        text += chunk.payload.text;
      } else if (chunk.type === "error") {
        throw new Error(`a turn on ${this.chat} ended in an error: ${chunk.payload.error}`);
      }
    }
    const finished = performance.now() - started;
    if (first === undefined) throw new Error(`a turn on ${this.chat} ended without a text delta`);
    this.messages.push({ id: `${this.chat}-a${this.turns}`, role: "assistant", parts: [{ type: "text", text }] });
    return [first / 1000, finished / 1000];
  }
}

const cpu = () => {
  const { user, system } = process.cpuUsage();
  return (user + system) / 1e6;
};
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const threads = Array.from({ length: threadCount }, (_, n) => new Thread(n));
await new Thread("warm-up").turn();
for (const t of threads) await t.turn(); // each thread's first turn, unmeasured, as turn_cost.py does
let at = performance.now();
let before = cpu();
await sleep(idleS * 1000);
const idle = (cpu() - before) / ((performance.now() - at) / 1000);
at = performance.now();
before = cpu();
const timed = await Promise.all(
  Array.from({ length: turns }, async (_, n) => {
    await sleep(Math.max(0, at + (n / rate) * 1000 - performance.now()));
    return threads[n % threads.length].turn();
  }),
);
const span = (performance.now() - at) / 1000;
const perTurn = (cpu() - before - idle * span) / turns;
console.log(JSON.stringify({ firsts: timed.map(([f]) => f), finishes: timed.map(([, f]) => f), span, idle, perTurn }));
process.exit(0);
