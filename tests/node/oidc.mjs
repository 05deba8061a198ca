// A real OpenID Connect provider (the `oidc-provider` package, an OpenID-certified
// implementation) on loopback, for the gateway's identity tests (tests/kafka/test_gateway_identity.py):
//   node oidc.mjs PORT KEYS_FILE AUDIENCE [PAGE_ORIGIN]
// KEYS_FILE holds its private signing keys (a JWKS; the first one signs, the others are still
// published: a key rotated out). It serves:
// - the client credentials grant to clients `alice` and `bob` (secret `secret`): a JWT access
//   token for the resource asked (`resource=...`, AUDIENCE by default) whose `sub` is the client;
// - the authorization code grant with PKCE to the public client `chat-page`, redirecting to
//   PAGE_ORIGIN/ (a browser signs in on the provider's own development login and consent forms:
//   any login, the account id is the login), and refresh tokens for it.
// Prints `ready` once listening.
import { readFileSync } from "node:fs";
import Provider from "oidc-provider";

const [port, keysFile, audience, pageOrigin = "http://127.0.0.1:1"] = process.argv.slice(2);
const jwks = JSON.parse(readFileSync(keysFile, "utf8"));
const service = (id) => ({ client_id: id, client_secret: "secret", grant_types: ["client_credentials"], redirect_uris: [], response_types: [] });

const provider = new Provider(`http://127.0.0.1:${port}`, {
  jwks,
  clients: [
    service("alice"),
    service("bob"),
    {
      client_id: "chat-page",
      token_endpoint_auth_method: "none",
      grant_types: ["authorization_code", "refresh_token"],
      response_types: ["code"],
      redirect_uris: [`${pageOrigin}/`],
    },
  ],
  clientDefaults: { id_token_signed_response_alg: "ES256" },  // the keys are ES256 (the default would be RS256)
  findAccount: (ctx, id) => ({ accountId: id, claims: () => ({ sub: id }) }),
  features: {
    clientCredentials: { enabled: true },
    devInteractions: { enabled: true },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => audience,
      useGrantedResource: () => true,
      getResourceServerInfo: (ctx, resource) => ({ scope: "chat", audience: resource, accessTokenFormat: "jwt", jwt: { sign: { alg: "ES256" } } }),
    },
  },
  scopes: ["openid", "offline_access"],
  issueRefreshToken: () => true,
  clientBasedCORS: () => true,
});
provider.proxy = false;
provider.listen(Number(port), "127.0.0.1", () => console.log("ready"));
