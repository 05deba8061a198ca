// The gateway's chat page in a real browser (Debian's Chromium, puppeteer-core), two tabs of one
// user on one conversation. Run by tests/kafka/test_gateway.py on the gateways whose runner
// streams slowly (MODEL_URL, MODEL_2_URL: `slow N` is N tokens 0.15 s apart; JWT_KEY signs
// the users' tokens): the second tab, open since before the first's message (a phone, another
// window), sends while the first's reply streams, under each policy the page offers
// (MEMFILTER_CONCURRENT_TURNS, docs/delivery.md); a reload then shows the conversation as stored.
import { test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import puppeteer from "puppeteer-core";
import { token } from "./client.mjs";

const RUN = randomUUID().slice(0, 8);

const tab = async (browser, gateway, user, chat) => {
  const page = await browser.newPage();
  const errors = [];
  page.on("pageerror", (e) => errors.push(e.message));
  await page.goto(`${gateway}/?token=${token(user)}&chat=${chat}`);
  await page.waitForSelector("#input");
  page.errors = errors;
  return page;
};
// A tab in the background runs no animation frames: every wait here polls on a timer instead.
const send = async (page, text, turns = "") => {
  await page.bringToFront();
  await page.select("#turns", turns);
  await page.type("#input", text);
  await page.keyboard.press("Enter");
};
const status = (page) => page.$eval("#status", (s) => s.innerText);
const rows = (page) => page.$$eval("#messages li", (rs) => rs.map((r) => [r.querySelector("b").innerText, r.querySelector(".text")?.innerText.trim() ?? ""]));
const streaming = (page) => page.waitForFunction(() => document.querySelector("#messages li.assistant .text")?.innerText.split(" ").length > 2, { timeout: 30_000, polling: 100 });
const answered = (page, n, timeout = 60_000) =>
  page.waitForFunction((n) => document.querySelectorAll("#messages li.assistant").length === n && document.querySelector("#status").innerText === "ready", { timeout, polling: 100 }, n);
// Two tabs of one user on one conversation, each on its own gateway; no page error in either.
const twoTabs = async (name, run) => {
  const browser = await puppeteer.launch({ executablePath: process.env.CHROMIUM, headless: true, args: ["--no-sandbox"] });
  try {
    const [user, chat] = [`${name}-${RUN}`, `${name}-page-${RUN}`];
    const first = await tab(browser, process.env.MODEL_URL, user, chat);
    const second = await tab(browser, process.env.MODEL_2_URL, user, chat);
    await run(first, second);
    assert.deepEqual([...first.errors, ...second.errors], []);
  } finally {
    await browser.close();
  }
};
const stored = async (page) => {
  await page.reload();
  await page.waitForSelector("#messages li");
  return rows(page);
};

test("a second tab's message waits for the reply being made, says so, and is answered after it", () =>
  twoTabs("queue", async (first, second) => {
    await send(first, "slow 40");
    await streaming(first);
    await send(second, "and another thing", "enqueue");
    await second.waitForFunction(() => document.querySelector("#status").innerText === "waiting for the reply being made to end", { timeout: 10_000, polling: 100 });
    assert.deepEqual(await rows(second), [["user", "and another thing"]]); // queued: no answer begun
    await answered(second, 1);
    assert.equal((await rows(second))[1][1], "model says 3"); // its model saw the question, the first reply and this message
    const shown = await stored(second);
    assert.deepEqual(shown.map(([role]) => role), ["user", "assistant", "user", "assistant"]);
    assert.equal(shown[1][1], Array.from({ length: 40 }, (_, i) => `t${i}`).join(" ")); // the first reply, whole, before the second message
  }));

test("a second tab's message interrupts the reply being made, which shows interrupted in the first, or is refused saying why", () =>
  twoTabs("cut", async (first, second) => {
    await send(first, "slow 200");
    await streaming(first);
    await send(second, "stop, I meant this", "interrupt");
    await first.waitForFunction(() => document.querySelector("#messages li.assistant b")?.innerText === "assistant (interrupted)", { timeout: 30_000, polling: 100 });
    await answered(second, 1);
    const shown = await stored(second);
    assert.deepEqual(shown.map(([role]) => role), ["user", "assistant (interrupted)", "user", "assistant"]);
    assert.ok(shown[1][1].split(" ").length < 200, "the first reply was cut");
    assert.equal(shown[3][1], "model says 3");

    await send(first, "slow 40");
    await first.waitForFunction(() => document.querySelectorAll("#messages li.assistant").length === 2, { timeout: 30_000, polling: 100 });
    await streaming(first);
    await send(second, "me too", "reject");
    await second.waitForFunction(() => document.querySelector("#status").innerText.startsWith("error: busy-thread: thread "), { timeout: 10_000, polling: 100 });
    assert.match(await status(second), /is answering request .*send it again once that reply ends/);
  }));
