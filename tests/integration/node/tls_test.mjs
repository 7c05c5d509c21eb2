// numoe-router over HTTPS through the official openai client: a custom https.Agent that trusts the test's
// self-signed certificate (run_node_test.sh ... tls makes it), then models, a completion and a stream.
// Without the agent the certificate is refused. Expected text: the fake worker echoes the prompt.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import https from 'node:https';
import OpenAI from 'openai';

const [root, apiKey, caFile] = process.argv.slice(2);
assert.ok(root.startsWith('https://'), root);
const httpAgent = new https.Agent({ ca: fs.readFileSync(caFile), keepAlive: true });
const client = new OpenAI({ baseURL: `${root}/v1`, apiKey, maxRetries: 0, httpAgent });

async function main() {
  const models = await client.models.list();
  assert.equal(models.data[0].id, 'tiny-v4');

  const c = await client.completions.create({ model: 'tiny-v4', prompt: 'Hello, world!', max_tokens: 6 });
  assert.equal(c.choices[0].text, 'Hello, world!');

  let text = '';
  const stream = await client.completions.create({ model: 'tiny-v4', prompt: 'Hello, world!', max_tokens: 6,
                                                   stream: true });
  for await (const chunk of stream) text += chunk.choices[0]?.text ?? '';
  assert.equal(text, 'Hello, world!');

  // A wrong key is still a 401 over TLS.
  const bad = new OpenAI({ baseURL: `${root}/v1`, apiKey: 'wrong', maxRetries: 0, httpAgent });
  await assert.rejects(bad.models.list(), (e) => e.status === 401);

  // The default agent does not trust a self-signed certificate.
  const untrusted = new OpenAI({ baseURL: `${root}/v1`, apiKey, maxRetries: 0 });
  await assert.rejects(untrusted.models.list(), (e) => e instanceof OpenAI.APIConnectionError);
  console.log('tls_test: ok');
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
