// The gateway's chat page: the AI SDK's own client (`AbstractChat`, the logic `useChat` runs,
// over `DefaultChatTransport`) against this gateway, rendered without a framework. Bundled
// into chat.js by `npm run build` (deploy/setup.sh runs it). The gateway serves index.html with
// its identity mode in `window.MEMFILTER`, and the gateway's address (empty: this page's own
// origin; a page served elsewhere names it, and the gateway allows its origin:
// MEMFILTER_GATEWAY_CORS_ORIGINS); `?user=` names the caller in header mode (a local
// demo: anyone on the page may name anyone), `?token=` carries a JWT in jwt mode; `?chat=`
// names the thread (a new one otherwise, kept in the address so a reload shows it). A reload
// while a reply is being made resumes it (`resumeStream`); "stop" stops it on the server
// (`POST /api/chat/{id}/stop`: the reply is saved as it stands) as well as in the page. "If a
// reply is being made" picks what a message sent meanwhile (from another tab, say) does
// (`concurrentTurns`: wait for it, interrupt it, be refused; the deployment's by default): one
// that waits says so while it does (the gateway's transient `data-turn` part), a reply cut
// by another's message says "interrupted", a refused one shows the gateway's reason.
import { AbstractChat, DefaultChatTransport, lastAssistantMessageIsCompleteWithToolCalls } from "ai";

const config = window.MEMFILTER;
const params = new URLSearchParams(location.search);
if (!params.get("chat")) {
  params.set("chat", `chat-${crypto.randomUUID().slice(0, 8)}`);
  history.replaceState(null, "", `?${params}`);
}
const chatId = params.get("chat");
const gateway = config.gateway ?? "";
const headers = config.auth === "jwt" ? { Authorization: `Bearer ${params.get("token") ?? ""}` } : { [config.resourceHeader]: params.get("user") ?? "demo" };

// What the chat keeps its messages and status in; every change shows on the page.
class State {
  #status = "ready";
  #error = undefined;
  messages = [];
  constructor(messages) { this.messages = messages; }
  get status() { return this.#status; }
  set status(value) { this.#status = value; render(); }
  get error() { return this.#error; }
  set error(value) { this.#error = value; render(); }
  pushMessage = (m) => { this.messages = [...this.messages, m]; render(); };
  popMessage = () => { this.messages = this.messages.slice(0, -1); render(); };
  replaceMessage = (i, m) => { this.messages = this.messages.map((old, j) => (j === i ? m : old)); render(); };
  snapshot = (thing) => structuredClone(thing);
}

const el = (tag, attrs = {}, ...children) => {
  const node = Object.assign(document.createElement(tag), attrs);
  node.append(...children);
  return node;
};

let chat;
let waiting = false; // the last message sent waits for the reply being made (`data-turn`)

function part(message, p) {
  if (p.type === "text") return el("div", { className: "text" }, p.text);
  if (p.type === "reasoning") return el("div", { className: "reasoning" }, p.text);
  if (p.type.startsWith("tool-") || p.type === "dynamic-tool") {
    const name = p.type === "dynamic-tool" ? p.toolName : p.type.slice(5);
    const box = el("div", { className: "tool" }, `${name}(${JSON.stringify(p.input)})`);
    if (p.state === "output-available") box.append(el("span", {}, ` → ${JSON.stringify(p.output)}`));
    else if (p.state === "input-available") {
      const answer = el("input", { placeholder: "the tool's output", className: "tool-output" });
      const send = el("button", { textContent: "answer" });
      send.onclick = () => chat.addToolOutput({ tool: name, toolCallId: p.toolCallId, output: answer.value });
      box.append(answer, send);
    }
    return box;
  }
  return null;
}

function render() {
  if (!chat) return;
  const list = document.getElementById("messages");
  list.replaceChildren(
    ...chat.messages.map((m, i) => {
      const interrupted = m.metadata?.finishReason === "interrupted";
      const label = el("b", {}, interrupted ? `${m.role} (interrupted)` : m.role);
      const row = el("li", { className: interrupted ? `${m.role} interrupted` : m.role }, label, ...m.parts.map((p) => part(m, p)).filter(Boolean));
      if (m.role === "user") {
        const edit = el("button", { textContent: "edit", className: "edit" });
        edit.onclick = () => {
          const text = prompt("edit message", m.parts.find((p) => p.type === "text")?.text ?? "");
          if (text) chat.sendMessage({ text, messageId: m.id });
        };
        row.append(edit);
      } else if (i === chat.messages.length - 1) {
        const again = el("button", { textContent: "regenerate", className: "regenerate" });
        again.onclick = () => chat.regenerate();
        row.append(again);
      }
      return row;
    }),
  );
  if (chat.status !== "submitted") waiting = false;
  const status = chat.status === "error" ? `error: ${refusal(chat.error?.message)}` : waiting ? "waiting for the reply being made to end" : chat.status;
  document.getElementById("status").textContent = status;
  document.getElementById("stop").hidden = !["submitted", "streaming"].includes(chat.status);
}

// The gateway's reason for a refusal (its JSON error answer), else the error as it came.
function refusal(message) {
  try {
    const { error } = JSON.parse(message);
    return `${error.code}: ${error.message}`;
  } catch {
    return message;
  }
}

// A stop the server hears: the fetch's abort alone cannot be told from a dropped connection.
async function stop() {
  await fetch(`${gateway}/api/chat/${encodeURIComponent(chatId)}/stop`, { method: "POST", headers });
  await chat.stop();
}

async function start() {
  // the stored conversation; none when the gateway cannot be reached (the first send says why)
  const stored = await fetch(`${gateway}/api/threads/${encodeURIComponent(chatId)}/messages`, { headers })
    .then((reply) => (reply.ok ? reply.json() : []))
    .catch(() => []);
  chat = new AbstractChat({
    id: chatId,
    state: new State(stored),
    transport: new DefaultChatTransport({ api: `${gateway}/api/chat`, headers }),
    sendAutomaticallyWhen: lastAssistantMessageIsCompleteWithToolCalls,
    onError: render,
    onData: (part) => {
      if (part.type === "data-turn") {
        waiting = Boolean(part.data?.waiting);
        render();
      }
    },
  });
  document.getElementById("form").onsubmit = (e) => {
    e.preventDefault();
    const input = document.getElementById("input");
    const turns = document.getElementById("turns").value;
    if (input.value.trim()) chat.sendMessage({ text: input.value }, turns ? { body: { concurrentTurns: turns } } : undefined);
    input.value = "";
  };
  document.getElementById("stop").onclick = stop;
  render();
  await chat.resumeStream(); // a reply still being made (a reload mid-reply): replayed and followed; none: nothing
}

start();
