// A real OpenID provider (panva's oidc-provider) for Inferno's access-control tests, serving
// HTTPS on 127.0.0.1. Run by tests/appliance/auth/idp.py as `node provider.mjs CONFIG.json`;
// prints one JSON line {"issuer": ...} once it listens.
//
// CONFIG: port (0 picks one), cert and key (PEM files), jwks (private JWKs: the first one signs),
// audience (the resource indicator whose access tokens are RFC 9068 JWTs), clients (client
// metadata), clientClaims (client_id -> extra access-token claims for client credentials),
// users (login -> {password, claims}: claims go into the user's access tokens).
import { readFileSync } from 'node:fs';
import { createServer } from 'node:https';
import Provider, { errors } from 'oidc-provider';

const config = JSON.parse(readFileSync(process.argv[2], 'utf8'));
const server = createServer({ cert: readFileSync(config.cert), key: readFileSync(config.key) });
await new Promise((resolve) => server.listen(config.port, '127.0.0.1', resolve));
const issuer = `https://127.0.0.1:${server.address().port}`;
const signingAlg = config.alg ?? 'ES256';

const provider = new Provider(issuer, {
  clients: config.clients,
  clientDefaults: { id_token_signed_response_alg: signingAlg },
  jwks: config.jwks,
  cookies: { keys: ['inferno-test-idp-cookie-key'] },
  findAccount: async (ctx, accountId) => {
    if (!config.users[accountId]) return undefined;
    return { accountId, claims: async () => ({ sub: accountId }) };
  },
  extraTokenClaims: async (ctx, token) => {
    if (token.kind === 'ClientCredentials') return config.clientClaims[token.clientId];
    return config.users[token.accountId]?.claims;
  },
  features: {
    devInteractions: { enabled: false },
    clientCredentials: { enabled: true },
    // oidc-provider's own logout pages load a web font from Google; the console's browser
    // tests check that nothing leaves 127.0.0.1, so these pages are plain.
    rpInitiatedLogout: {
      enabled: true,
      logoutSource: async (ctx, form) => {
        ctx.body = `<!DOCTYPE html><title>Sign out</title>${form}`
          + '<button type="submit" form="op.logoutForm" value="yes" name="logout">Sign out</button>';
      },
      postLogoutSuccessSource: async (ctx) => {
        ctx.body = '<!DOCTYPE html><title>Signed out</title><p>Signed out.</p>';
      },
    },
    resourceIndicators: {
      enabled: true,
      defaultResource: () => config.audience,
      useGrantedResource: () => true,
      getResourceServerInfo: (ctx, resourceIndicator) => {
        if (resourceIndicator !== config.audience) throw new errors.InvalidTarget();
        return {
          scope: 'api',
          audience: config.audience,
          accessTokenTTL: config.accessTokenTTL ?? 600,
          accessTokenFormat: 'jwt',
          jwt: { sign: { alg: signingAlg } },
        };
      },
    },
  },
  interactions: { url: (ctx, interaction) => `/interaction/${interaction.uid}` },
});

// The login page: a form checked against `users`; consent is granted at once (a first-party
// application), as enterprise IdPs do for pre-approved clients.
async function interaction(req, res) {
  const uid = req.url.split('/')[2];
  const details = await provider.interactionDetails(req, res);
  if (details.prompt.name === 'consent') {
    const grant = new provider.Grant({ accountId: details.session.accountId, clientId: details.params.client_id });
    const missing = details.prompt.details;
    if (missing.missingOIDCScope) grant.addOIDCScope(missing.missingOIDCScope.join(' '));
    if (missing.missingOIDCClaims) grant.addOIDCClaims(missing.missingOIDCClaims);
    for (const [resource, scopes] of Object.entries(missing.missingResourceScopes ?? {})) {
      grant.addResourceScope(resource, scopes.join(' '));
    }
    const grantId = await grant.save();
    return provider.interactionFinished(req, res, { consent: { grantId } }, { mergeWithLastSubmission: true });
  }
  if (req.method === 'GET') {
    res.setHeader('content-type', 'text/html; charset=utf-8');
    return res.end(`<!DOCTYPE html><form method="post" action="/interaction/${uid}">`
      + '<input name="login"><input name="password" type="password"><button>Sign in</button></form>');
  }
  const form = new URLSearchParams(await body(req));
  const user = config.users[form.get('login')];
  if (!user || user.password !== form.get('password')) {
    res.statusCode = 401;
    return res.end('wrong login or password');
  }
  return provider.interactionFinished(req, res, { login: { accountId: form.get('login') } }, { mergeWithLastSubmission: false });
}

async function body(req) {
  const chunks = [];
  for await (const chunk of req) chunks.push(chunk);
  return Buffer.concat(chunks).toString('utf8');
}

const callback = provider.callback();
server.on('request', (req, res) => {
  if (req.url.startsWith('/interaction/')) {
    interaction(req, res).catch((error) => {
      res.statusCode = 500;
      res.end(String(error));
    });
  } else {
    callback(req, res);
  }
});
process.stdout.write(`${JSON.stringify({ issuer })}\n`);
