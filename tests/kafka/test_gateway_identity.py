"""The gateway's callers, signed in by a real OpenID Connect provider: `oidc-provider` (an
OpenID-certified implementation, tests/node/oidc.mjs) on loopback, its JWT access tokens checked
against its published keys (MEMFILTER_GATEWAY_JWKS_URL), issuer and audience, with a worker and
the echo agent runner behind the gateway.

A token of the provider's gets its turn answered; a token for another audience, from another
issuer (the same keys, another provider), unsigned (`alg: none`), HS256 "signed" with the
provider's public key, or signed by a key the provider never published is refused, 401 with
the reason. The provider rotates its signing key while a user is signed in: the new token is
verified (its key fetched on first sight), the old one still is. A flood of tokens naming
invented key ids costs the provider one fetch of its keys every JWKS_MIN_REFETCH_S, no more."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import http.server
import json
import secrets
import shutil
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp
import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from jwt.algorithms import ECAlgorithm
from pipeline import REPO, WORKER_LOGS, free_port, node_test, wait_for_line

from memfilter.gateway.identity import JWKS_MIN_REFETCH_S
from memfilter.gateway.server import PAGE

pytestmark = pytest.mark.xdist_group("gateway-identity")  # the module's provider, worker and gateway are shared (`--dist loadgroup`)

AUDIENCE = "https://chat.memfilter.test"


def signing_key(kid: str) -> tuple[dict, ec.EllipticCurvePrivateKey]:
    """A new ES256 key pair: its private JWK (for the provider), and the key."""
    private = ec.generate_private_key(ec.SECP256R1())
    return {**json.loads(ECAlgorithm.to_jwk(private)), "kid": kid, "alg": "ES256", "use": "sig"}, private


class Provider:
    """`node tests/node/oidc.mjs` on a port of its own; started again on other keys to rotate them."""

    def __init__(self, folder: Path, keys: list[dict], page_origin: str = "http://127.0.0.1:1"):
        self.port, self.folder, self.page_origin = free_port(), folder, page_origin
        self.process: subprocess.Popen | None = None
        self.start(keys)

    @property
    def issuer(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, keys: list[dict]) -> None:
        self.stop()
        (self.folder / "keys.json").write_text(json.dumps({"keys": keys}))
        log = WORKER_LOGS / f"memfilter-test-oidc-{self.port}.log"
        self.process = subprocess.Popen(
            ["node", "oidc.mjs", str(self.port), str(self.folder / "keys.json"), AUDIENCE, self.page_origin],
            cwd=REPO / "tests" / "node",
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
        )
        wait_for_line(log, "ready", timeout=30)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)

    def token(self, client: str = "alice", resource: str = AUDIENCE) -> str:
        """An access token of the client credentials grant: `sub` is the client."""
        data = f"grant_type=client_credentials&scope=chat&resource={resource}".encode()
        ask = urllib.request.Request(f"{self.issuer}/token", data=data, headers={"Authorization": "Basic " + _basic(client, "secret")})
        with urllib.request.urlopen(ask, timeout=10) as answer:
            return json.loads(answer.read())["access_token"]


def _basic(user: str, password: str) -> str:
    import base64

    return base64.b64encode(f"{user}:{password}".encode()).decode()


class Origin:
    """The gateway's chat page served from an origin of its own (an app's site): its index.html
    naming the gateway's address, and the built chat.js."""

    def __init__(self, gateway: str, port: int = 0):
        page = (
            (PAGE / "index.html").read_text().replace("__CONFIG__", json.dumps({"auth": "jwt", "resourceHeader": "X-Memfilter-Resource", "gateway": gateway}))
        )
        files = {"/": (page.encode(), "text/html"), "/chat.js": ((PAGE / "chat.js").read_bytes(), "text/javascript")}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                body, kind = files.get(self.path.split("?")[0], (b"", "text/plain"))
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", kind)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def identity(services, tmp_path_factory):
    """Provider A (the gateway's, keys [k1]), provider B (another issuer, the same keys), and a
    gateway trusting A and allowing pages from `app`, with a worker and the echo agent:
    (A, B, the gateway's URL, its port, app, other): app and other serve the chat page from
    origins of their own, started once the gateway's address is known."""
    k1, _ = signing_key("k1")
    app_port = free_port()
    app_origin = f"http://127.0.0.1:{app_port}"
    a, b = Provider(tmp_path_factory.mktemp("a"), [k1], app_origin), Provider(tmp_path_factory.mktemp("b"), [k1])
    pipeline = services.pipeline()
    asyncio.run(pipeline.create_topics())
    try:
        pipeline.start_answering()
        port = pipeline.start_gateway(
            "oidc",
            MEMFILTER_GATEWAY_AUTH="jwt",
            MEMFILTER_GATEWAY_JWKS_URL=f"{a.issuer}/jwks",
            MEMFILTER_GATEWAY_ISSUER=a.issuer,
            MEMFILTER_GATEWAY_AUDIENCE=AUDIENCE,
            MEMFILTER_GATEWAY_CORS_ORIGINS=app_origin,
        )
        gateway = f"http://127.0.0.1:{port}"
        app, other = Origin(gateway, app_port), Origin(gateway)
        yield a, b, gateway, port, app, other
    finally:
        pipeline.stop_all()
        asyncio.run(pipeline.delete_topics())
        a.stop()
        b.stop()


async def turn(gateway: str, token: str) -> tuple[int, str]:
    """One useChat turn with this bearer token: the status, and the answer's text (or the error's message)."""
    chat = f"oidc-{uuid.uuid4().hex[:8]}"
    body = {"id": chat, "trigger": "submit-message", "messages": [{"id": f"{chat}-u0", "role": "user", "parts": [{"type": "text", "text": "hi"}]}]}
    async with aiohttp.ClientSession() as http, http.post(f"{gateway}/api/chat", json=body, headers={"Authorization": f"Bearer {token}"}) as r:
        if r.status != 200:
            return r.status, (await r.json())["error"]["message"]
        events = [line.removeprefix("data: ") for line in (await r.text()).splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
        return 200, "".join(json.loads(e).get("delta", "") for e in events)


def forged(claims: dict, header: dict, sign) -> str:
    """A JWT put together by hand (PyJWT refuses to make these): base64url parts, `sign(signing input)`."""
    encode = lambda part: jwt.utils.base64url_encode(json.dumps(part).encode())  # noqa: E731
    signing_input = encode(header) + b"." + encode(claims)
    return (signing_input + b"." + jwt.utils.base64url_encode(sign(signing_input))).decode()


def test_a_providers_token_gets_its_turn_and_every_bad_token_is_refused_with_its_reason(identity):
    a, b, gateway, *_ = identity
    good = a.token()
    claims = jwt.decode(good, options={"verify_signature": False})
    assert (claims["iss"], claims["aud"], claims["sub"]) == (a.issuer, AUDIENCE, "alice")
    published = json.loads(urllib.request.urlopen(f"{a.issuer}/jwks").read())["keys"][0]
    public = ECAlgorithm.from_jwk(json.dumps(published)).public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    _, stranger = signing_key("k1")  # a key the provider never published, under a key id it did
    later = {**claims, "exp": int(time.time()) + 600}
    bad = {
        "another audience": a.token(resource="https://other.memfilter.test"),
        "another issuer": b.token(),
        "alg none": forged(later, {"alg": "none", "kid": "k1"}, lambda _: b""),
        "HS256 signed with the provider's public key": forged(later, {"alg": "HS256", "kid": "k1"}, lambda s: hmac.new(public, s, hashlib.sha256).digest()),
        "another key under the provider's key id": jwt.encode(later, stranger, algorithm="ES256", headers={"kid": "k1"}),
        "not a JWT": "not.a.jwt",
    }

    async def go():
        return await turn(gateway, good), {name: await turn(gateway, token) for name, token in bad.items()}

    answered, refused = asyncio.run(go())
    assert answered == (200, "echo: hi")
    reasons = {name: message for name, (status, message) in refused.items() if status == 401}
    assert reasons.keys() == bad.keys(), refused
    assert "its `aud` is not 'https://chat.memfilter.test'" in reasons["another audience"]
    assert f"not issued by '{a.issuer}'" in reasons["another issuer"]
    assert "signed with 'none'; its key takes ES256 alone" in reasons["alg none"]
    assert "signed with 'HS256'; its key takes ES256 alone" in reasons["HS256 signed with the provider's public key"]
    assert "does not verify: Signature verification failed" in reasons["another key under the provider's key id"]


def test_the_provider_rotates_its_key_and_a_signed_in_user_goes_on(identity):
    a, _, gateway, *_ = identity
    before = a.token("bob")
    assert asyncio.run(turn(gateway, before)) == (200, "echo: hi")
    k1 = json.loads((a.folder / "keys.json").read_text())["keys"][0]
    k2, _ = signing_key("k2")
    a.start([k2, k1])  # k2 signs from now on, published no earlier; k1 still is, for the tokens it signed
    time.sleep(JWKS_MIN_REFETCH_S)  # the gateway fetched the keys for `before` just now: it fetches again for a new key id no sooner
    after = a.token("bob")
    assert jwt.get_unverified_header(after)["kid"] == "k2"
    assert asyncio.run(turn(gateway, after)) == (200, "echo: hi")  # its key fetched on first sight
    assert asyncio.run(turn(gateway, before)) == (200, "echo: hi")


def test_a_flood_of_invented_key_ids_costs_the_provider_one_fetch_every_few_seconds(identity):
    a, _, gateway, port, *_ = identity
    claims = {**jwt.decode(a.token(), options={"verify_signature": False}), "exp": int(time.time()) + 600}
    _, key = signing_key("any")
    flood = [jwt.encode(claims, key, algorithm="ES256", headers={"kid": secrets.token_hex(4)}) for _ in range(60)]

    def fetches() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as metrics:
            line = next(line for line in metrics.read().decode().splitlines() if line.startswith("memfilter_gateway_jwks_fetches_total"))
        return float(line.split()[-1])

    before = fetches()

    async def go():
        return await asyncio.gather(*(turn(gateway, token) for token in flood))

    answers = asyncio.run(go())
    assert {status for status, _ in answers} == {401} and all("is not one of the identity provider's signing keys" in m for _, m in answers)
    assert fetches() - before <= 1  # sent within JWKS_MIN_REFETCH_S: one fetch at most


def test_a_user_signed_in_on_the_provider_chats_from_a_page_on_another_origin_through_a_key_rotation(identity):
    """In Chromium: the provider's login form, the page served from the app's origin (allowed:
    MEMFILTER_GATEWAY_CORS_ORIGINS), an answer; the page from an origin not allowed fails in
    the browser. Then the provider rotates its key: the user signs in again and goes on, and
    the token of before the rotation is still answered."""
    a, _, _, _, app, other = identity
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: deploy/test.sh installs it"
    env = {"PROVIDER": a.issuer, "AUDIENCE": AUDIENCE, "APP_ORIGIN": app.url, "OTHER_ORIGIN": other.url, "CHROMIUM": chromium, "USER": "carol", "HOME": "/tmp"}
    first = node_test("oidc-page.test.mjs", **env)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
    before = next(line.split("token: ")[1] for line in first.stdout.splitlines() if "token: " in line).strip()
    assert jwt.decode(before, options={"verify_signature": False})["sub"] == "carol"
    published = json.loads((a.folder / "keys.json").read_text())["keys"]  # the one that signed `before` among them
    k3, _ = signing_key("k3")
    a.start([k3, *published])
    time.sleep(JWKS_MIN_REFETCH_S)
    second = node_test("oidc-page.test.mjs", **env, TOKEN_BEFORE=before)
    assert second.returncode == 0, second.stdout[-4000:] + second.stderr[-2000:]
    after = next(line.split("token: ")[1] for line in second.stdout.splitlines() if "token: " in line).strip()
    assert jwt.get_unverified_header(after)["kid"] == "k3"
