// The AI SDK's own client (`AbstractChat`, the logic `useChat` runs, over `DefaultChatTransport`),
// set up as the gateway tests use it: a user's JWT under the gateway's HS256 key (JWT_KEY), or,
// for a gateway with header identity (RESOURCE_HEADER), the user in that header; messages kept
// in a plain in-memory state, and the stored conversation read back through
// `GET /api/threads/{id}/messages`.
import { createHmac } from "node:crypto";
import { AbstractChat, DefaultChatTransport } from "ai";

const KEY = process.env.JWT_KEY;
const HEADER = process.env.RESOURCE_HEADER;

// The issuer and audience a gateway checks (MEMFILTER_GATEWAY_ISSUER, MEMFILTER_GATEWAY_AUDIENCE), when it does.
const ISSUER = process.env.JWT_ISSUER;
const AUDIENCE = process.env.JWT_AUDIENCE;

export function token(sub, { expiresIn = 600, key = KEY } = {}) {
  const b64 = (o) => Buffer.from(JSON.stringify(o)).toString("base64url");
  const claims = { sub, exp: Math.floor(Date.now() / 1000) + expiresIn, ...(ISSUER && { iss: ISSUER }), ...(AUDIENCE && { aud: AUDIENCE }) };
  const body = `${b64({ alg: "HS256", typ: "JWT" })}.${b64(claims)}`;
  return `${body}.${createHmac("sha256", key).update(body).digest("base64url")}`;
}

// Who the requests are from: the user's token, or the header a proxy would set.
const identity = (user) => (HEADER ? { [HEADER]: user } : { Authorization: `Bearer ${token(user)}` });

// What `useChat` keeps a chat's messages in: a plain in-memory state; `onChange` sees each change.
class State {
  status = "ready";
  error = undefined;
  messages = [];
  constructor(onChange) { this.onChange = onChange ?? (() => {}); }
  pushMessage = (m) => { this.messages = [...this.messages, m]; this.onChange(this.messages); };
  popMessage = () => { this.messages = this.messages.slice(0, -1); };
  replaceMessage = (i, m) => { this.messages = this.messages.map((old, j) => (j === i ? m : old)); this.onChange(this.messages); };
  snapshot = (thing) => structuredClone(thing);
}

export class Chat extends AbstractChat {
  constructor({ user, gateway, headers = {}, messages = [], onChange, ...init }) {
    const state = new State(onChange);
    state.messages = messages;
    super({
      state,
      transport: new DefaultChatTransport({ api: `${gateway}/api/chat`, headers: () => ({ ...identity(user), ...headers }) }),
      ...init,
    });
  }
}

export const text = (m) => m.parts.filter((p) => p.type === "text").map((p) => p.text).join("");

export async function stored(gateway, chatId, user) {
  const r = await fetch(`${gateway}/api/threads/${encodeURIComponent(chatId)}/messages`, { headers: identity(user) });
  return { status: r.status, body: await r.json() };
}

// A message as both sides keep it: what the client shows and what is stored must agree on these.
export const kept = (m) => JSON.parse(JSON.stringify({ id: m.id, role: m.role, parts: m.parts, metadata: m.metadata }));

// `what()` once `ok` holds of it, polled every 50 ms; an error with its last value after `ms`.
export const until = async (what, ok, ms = 20_000) => {
  for (const end = Date.now() + ms; Date.now() < end; await new Promise((r) => setTimeout(r, 50))) {
    const got = await what();
    if (ok(got)) return got;
  }
  throw new Error(`timed out waiting: ${JSON.stringify(await what()).slice(0, 500)}`);
};

// A chat's reply: its first assistant message.
export const answer = (messages) => messages.find((m) => m.role === "assistant");
