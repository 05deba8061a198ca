// The gateway's chat page in a real browser: Debian's Chromium, driven by puppeteer-core. Run
// by tests/kafka/test_gateway.py, which starts a gateway (header identity, as run-local's) with
// a worker and the echo agent, and passes GATEWAY_URL, CHROMIUM and SCREENSHOT (where the
// screenshot is kept).
import { test } from "node:test";
import assert from "node:assert/strict";
import { randomUUID } from "node:crypto";
import puppeteer from "puppeteer-core";

const RUN = randomUUID().slice(0, 8);

test("a message typed into the page gets the answer, and a reload shows the stored history", async () => {
  const browser = await puppeteer.launch({ executablePath: process.env.CHROMIUM, headless: true, args: ["--no-sandbox"] });
  try {
    const page = await browser.newPage();
    const errors = [];
    page.on("pageerror", (e) => errors.push(e.message));
    await page.goto(`${process.env.GATEWAY_URL}/?user=page-${RUN}&chat=page-${RUN}`);
    await page.waitForSelector("#input");
    await page.type("#input", "hello from the page");
    await page.keyboard.press("Enter");
    await page.waitForFunction(() => document.querySelector("#messages").innerText.includes("echo: hello from the page"), { timeout: 30_000 });
    await page.screenshot({ path: process.env.SCREENSHOT });

    // After a reload the reply shows whole: from the stored history once saved, or resumed
    // (`resumeStream`) while its save is still on its way; wait for its text either way.
    await page.reload();
    await page.waitForFunction(() => document.querySelector("#messages li.assistant .text")?.innerText === "echo: hello from the page", { timeout: 30_000 });
    const shown = await page.$$eval("#messages li", (rows) => rows.map((r) => [r.className, r.querySelector(".text")?.innerText]));
    assert.deepEqual(shown, [["user", "hello from the page"], ["assistant", "echo: hello from the page"]]);
    assert.deepEqual(errors, []);
  } finally {
    await browser.close();
  }
});
