// Mastra's working memory rules, from @mastra/memory 1.31.0 itself: its template, its system
// instruction, its merge, and its updateWorkingMemory tool run against a stored document (the
// tool's own validation included). tests/unit/test_working_memory.py sends one JSON document on
// standard input:
//   {templates: [{template?, schema?}], instructions: [{template?, schema?, data}],
//    merges: [[existing, update]], calls: [{template?, schema?, existing, given}], tools: [{template?, schema?}]}
// and reads back, in the same order: each template, each instruction, each merge, for each
// call what the tool answered and the stored document after it, and each tool as the model is
// offered it (its name, description and input JSON Schema).
import { Memory, deepMergeWorkingMemory } from '@mastra/memory';

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const input = JSON.parse(Buffer.concat(chunks).toString('utf8'));

const config = ({ template, schema }) => ({ enabled: true, ...(template !== undefined ? { template } : {}), ...(schema !== undefined ? { schema } : {}) });
const memoryOf = (c) => new Memory({ options: { workingMemory: config(c) } });

async function call(c) {
  const memory = memoryOf(c);
  const template = await memory.getWorkingMemoryTemplate({});
  const tool = Object.values(memory.listTools({ workingMemory: config(c) }))[0];
  let stored = c.existing;
  const store = {
    getThreadById: async () => ({ id: 't1', resourceId: 'r1' }),
    getWorkingMemory: async () => stored || null,
    updateWorkingMemory: async ({ workingMemory }) => { stored = workingMemory; },
    getWorkingMemoryTemplate: async () => template,
  };
  const answer = await tool.execute(c.given, { agent: { threadId: 't1', resourceId: 'r1' }, memory: store });
  return { answer: answer ?? null, stored: stored ?? null };
}

const out = {
  templates: await Promise.all(input.templates.map((c) => memoryOf(c).getWorkingMemoryTemplate({}))),
  instructions: await Promise.all(
    input.instructions.map(async (c) => {
      const memory = memoryOf(c);
      return memory.getWorkingMemoryToolInstruction({ template: await memory.getWorkingMemoryTemplate({}), data: c.data });
    }),
  ),
  merges: input.merges.map(([existing, update]) => deepMergeWorkingMemory(existing, update)),
  calls: [],
};
for (const c of input.calls) out.calls.push(await call(c));
out.tools = (input.tools ?? []).map((c) => {
  const [[name, tool]] = Object.entries(memoryOf(c).listTools({ workingMemory: config(c) }));
  const schema = tool.inputSchema['~standard']?.jsonSchema?.input?.({ target: 'draft-07' }) ?? tool.inputSchema;
  return { name, description: tool.description, parameters: schema };
});
process.stdout.write(JSON.stringify(out));
