// numoe-router through the official openai client: completions and chat completions, streaming and not,
// /tokenize and /detokenize against the chat path's prompt_token_ids,
// and errors. Expected values follow from the fake worker's rule (echo the prompt without BOS, or reply with
// the text after "REPLY:", "[/think]" standing for </think>) and the tokenizer fixture ("Hello, world!" is
// ids [47, 477, 86, 19, 707, 8]).
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const [root, apiKey] = process.argv.slice(2);
const baseURL = `${root}/v1`;
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const hello = [47, 477, 86, 19, 707, 8];

async function main() {
  const models = await client.models.list();
  assert.equal(models.data[0].id, 'tiny-v4');

  // Completions, whole and streamed (vLLM extensions pass through as extra body fields).
  const c = await client.completions.create({ model: 'tiny-v4', prompt: 'Hello, world!', max_tokens: 6,
                                              return_token_ids: true });
  assert.equal(c.object, 'text_completion');
  assert.equal(c.choices[0].text, 'Hello, world!');
  assert.equal(c.choices[0].finish_reason, 'length');
  assert.deepEqual(c.choices[0].token_ids, hello);
  const { prompt_tokens_details: cDetails, ...cUsage } = c.usage;
  assert.deepEqual(cUsage, { prompt_tokens: 7, completion_tokens: 6, total_tokens: 13 });
  assert.ok(cDetails.cached_tokens >= 0 && cDetails.cached_tokens < 7);  // the prefix cache serves at most 6 of 7

  const ids = await client.completions.create({ model: 'tiny-v4', prompt: [5, 9, 1, 12], max_tokens: 6,
                                                ignore_eos: true, return_token_ids: true });
  assert.deepEqual(ids.choices[0].token_ids, [5, 9, 1, 12, 5, 9]);

  let text = '';
  let finish = null;
  let usage = null;
  const stream = await client.completions.create({ model: 'tiny-v4', prompt: 'Hello, world!', max_tokens: 6,
                                                   stream: true, stream_options: { include_usage: true } });
  for await (const chunk of stream) {
    if (chunk.usage) usage = chunk.usage;
    for (const ch of chunk.choices) {
      text += ch.text;
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  assert.equal(text, 'Hello, world!');
  assert.equal(finish, 'length');
  assert.equal(usage.completion_tokens, 6);

  // Chat completions, thinking mode: reasoning_content and content.
  const messages = [{ role: 'system', content: 'Be brief.' },
                    { role: 'user', content: 'REPLY:Two plus two.[/think]It is 4.' }];
  const chat = await client.chat.completions.create({ model: 'tiny-v4', messages, max_tokens: 50, thinking: true });
  assert.equal(chat.object, 'chat.completion');
  assert.equal(chat.choices[0].message.role, 'assistant');
  assert.equal(chat.choices[0].message.content, 'It is 4.');
  assert.equal(chat.choices[0].message.reasoning_content, 'Two plus two.');
  assert.equal(chat.choices[0].finish_reason, 'stop');

  let content = '';
  let reasoning = '';
  let role = null;
  finish = null;
  const chatStream = await client.chat.completions.create({ model: 'tiny-v4', messages, max_tokens: 50,
                                                            thinking: true, stream: true });
  for await (const chunk of chatStream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    const d = chunk.choices[0].delta;
    if (d.role) role = d.role;
    content += d.content ?? '';
    reasoning += d.reasoning_content ?? '';
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
  }
  assert.equal(role, 'assistant');
  assert.equal(content, 'It is 4.');
  assert.equal(reasoning, 'Two plus two.');
  assert.equal(finish, 'stop');

  // Tool calls through the client's own accumulation helper types.
  const call = 'REPLY:\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" ' +
               'string="true">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>';
  const tools = [{ type: 'function', function: { name: 'get_weather', parameters: { type: 'object' } } }];
  const tc = await client.chat.completions.create({ model: 'tiny-v4', messages: [{ role: 'user', content: call }],
                                                    tools, max_tokens: 200 });
  assert.equal(tc.choices[0].finish_reason, 'tool_calls');
  assert.equal(tc.choices[0].message.tool_calls[0].function.name, 'get_weather');
  assert.deepEqual(JSON.parse(tc.choices[0].message.tool_calls[0].function.arguments), { city: 'Paris' });

  // The chat path's prompt ids (vLLM's prompt_token_ids, with return_token_ids) are exactly what /tokenize
  // returns for the same messages and tools, and usage counts them.
  const weatherTools = [{ type: 'function', function: { name: 'get_weather', description: 'Get the weather',
    parameters: { type: 'object', properties: { location: { type: 'string' } }, required: ['location'] } } }];
  const history = [{ role: 'user', content: 'Weather in Paris?' },
                   { role: 'assistant', content: '', tool_calls: [{ id: 'c1', type: 'function',
                     function: { name: 'get_weather', arguments: '{"location": "Paris"}' } }] },
                   { role: 'tool', tool_call_id: 'c1', content: 'sunny' }];
  for (const thinking of [false, true]) {
    for (const withTools of [false, true]) {
      const fields = { messages: history, thinking, ...(withTools ? { tools: weatherTools } : {}) };
      const r = await client.chat.completions.create({ model: 'tiny-v4', max_tokens: 2, return_token_ids: true,
                                                       ...fields });
      const t = await fetch(`${root}/tokenize`, { method: 'POST', body: JSON.stringify(fields),
        headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${apiKey}` } }).then((x) => x.json());
      assert.deepEqual(r.prompt_token_ids, t.tokens, `thinking ${thinking}, tools ${withTools}`);
      assert.equal(r.usage.prompt_tokens, t.count);
      assert.equal(t.max_model_len, 1024);
      const d = await fetch(`${root}/detokenize`, { method: 'POST', body: JSON.stringify({ tokens: t.tokens }),
        headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${apiKey}` } }).then((x) => x.json());
      assert.ok(d.prompt.startsWith('<｜begin▁of▁sentence｜>'));
      assert.equal(d.prompt.includes('{"name": "get_weather", "description": "Get the weather", "parameters"'),
                   withTools, 'the tool schema is rendered in the client\'s key order');
    }
  }

  // Errors come back as the client's typed errors, with status, param and message, and service continues.
  await assert.rejects(client.completions.create({ model: 'tiny-v4', prompt: [5, 4096], max_tokens: 2 }),
                       (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === 'prompt' &&
                              /4096/.test(e.message));
  await assert.rejects(client.completions.create({ model: 'gpt-x', prompt: 'hi' }),
                       (e) => e instanceof OpenAI.NotFoundError && e.status === 404 && e.code === 'model_not_found');
  await assert.rejects(client.chat.completions.create({ model: 'tiny-v4', messages: [], max_tokens: 2 }),
                       (e) => e.status === 400 && e.param === 'messages');
  const bad = new OpenAI({ baseURL, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(bad.models.list(), (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
  const again = await client.completions.create({ model: 'tiny-v4', prompt: 'Hello, world!', max_tokens: 6 });
  assert.equal(again.choices[0].text, 'Hello, world!');
  console.log('openai client: all checks passed');
}

main().catch((e) => {
  console.error('FAILED:', e);
  process.exit(1);
});
