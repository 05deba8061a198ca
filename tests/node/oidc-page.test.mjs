// A user signs in on a real OpenID Connect provider (tests/node/oidc.mjs) in Debian's Chromium
// (puppeteer-core), then chats on the gateway's chat page served from another origin
// (APP_ORIGIN, which the gateway allows: MEMFILTER_GATEWAY_CORS_ORIGINS); the same page on an
// origin the gateway does not allow (OTHER_ORIGIN) is refused by the browser. Run by
// tests/kafka/test_gateway_identity.py, twice: before and after the provider rotates its key
// (the second run signs in again, and its token is signed by the new key; TOKEN_BEFORE, the
// first run's token, must still be answered). Prints the access token it got (`token: ...`).
import { test } from "node:test";
import assert from "node:assert/strict";
import { createHash, randomBytes, randomUUID } from "node:crypto";
import puppeteer from "puppeteer-core";

const { PROVIDER, AUDIENCE, APP_ORIGIN, OTHER_ORIGIN, CHROMIUM, USER, TOKEN_BEFORE } = process.env;
const RUN = randomUUID().slice(0, 8);
const b64url = (bytes) => Buffer.from(bytes).toString("base64url");

// The authorization code grant with PKCE, as a single-page app runs it: the provider's own
// login form in the browser, then the code exchanged for tokens.
async function signIn(page) {
  const verifier = b64url(randomBytes(32));
  const query = new URLSearchParams({
    client_id: "chat-page",
    response_type: "code",
    scope: "openid offline_access chat",
    resource: AUDIENCE,
    redirect_uri: `${APP_ORIGIN}/`,
    code_challenge: b64url(createHash("sha256").update(verifier).digest()),
    code_challenge_method: "S256",
    state: RUN,
  });
  await page.goto(`${PROVIDER}/auth?${query}`);
  await page.waitForSelector("input[name=login]");
  await page.type("input[name=login]", USER);
  await page.type("input[name=password]", "any");
  await Promise.all([page.waitForNavigation(), page.click("button[type=submit]")]);
  for (let i = 0; i < 5 && !page.url().startsWith(APP_ORIGIN); i++) {
    // the provider's consent step, when it shows one
    await Promise.all([page.waitForNavigation(), page.click("button[type=submit]")]);
  }
  const code = new URL(page.url()).searchParams.get("code");
  assert.ok(code, `no code in ${page.url()}`);
  const answer = await fetch(`${PROVIDER}/token`, {
    method: "POST",
    headers: { "content-type": "application/x-www-form-urlencoded" },
    body: new URLSearchParams({ grant_type: "authorization_code", code, code_verifier: verifier, client_id: "chat-page", redirect_uri: `${APP_ORIGIN}/`, resource: AUDIENCE }),
  });
  const tokens = await answer.json();
  assert.ok(tokens.access_token, JSON.stringify(tokens));
  return tokens.access_token;
}

async function say(page, origin, token, words) {
  await page.goto(`${origin}/?token=${token}&chat=oidc-${RUN}-${origin.split(":").at(-1)}`);
  await page.waitForSelector("#input");
  await page.type("#input", words);
  await page.keyboard.press("Enter");
}

test("a user signed in on the provider chats from a page on another origin, and an origin not allowed is refused", async () => {
  const browser = await puppeteer.launch({ executablePath: CHROMIUM, headless: true, args: ["--no-sandbox"] });
  try {
    const page = await browser.newPage();
    const token = await signIn(page);
    console.log(`token: ${token}`);
    await say(page, APP_ORIGIN, token, "hello across origins");
    await page.waitForFunction(() => document.querySelector("#messages").innerText.includes("echo: hello across origins"), { timeout: 30_000 });
    if (TOKEN_BEFORE) {  // the token of before the rotation: still answered
      await say(page, APP_ORIGIN, TOKEN_BEFORE, "still signed in");
      await page.waitForFunction(() => document.querySelector("#messages").innerText.includes("echo: still signed in"), { timeout: 30_000 });
    }
    await say(page, OTHER_ORIGIN, token, "from elsewhere");
    await page.waitForFunction(() => document.querySelector("#status").innerText.startsWith("error"), { timeout: 30_000 });
    assert.ok(!(await page.$eval("#messages", (m) => m.innerText)).includes("echo: from elsewhere"));
  } finally {
    await browser.close();
  }
});
