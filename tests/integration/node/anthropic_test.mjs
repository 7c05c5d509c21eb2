// numoe-router's Anthropic Messages API through the official @anthropic-ai/sdk client: a request with tools
// and thinking, whole and streamed (the SDK's own stream accumulator must rebuild the same message), a
// tool_result turn, stop sequences, count_tokens, and errors as the SDK's typed errors. Expected values follow
// from the fake worker's rule: it replies with the text after "REPLY:" in the prompt ("[/think]" standing for
// </think>), else echoes the prompt.
import assert from 'node:assert/strict';
import Anthropic from '@anthropic-ai/sdk';

const [root, apiKey] = process.argv.slice(2);
const client = new Anthropic({ baseURL: root, apiKey, maxRetries: 0 });  // sends x-api-key + anthropic-version

const call = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" ' +
             'string="true">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n' +
             '</｜DSML｜invoke>\n</｜DSML｜tool_calls>';
const tools = [{ name: 'get_weather', input_schema: { type: 'object' } }];

async function main() {
  const request = {
    model: 'tiny-v4', max_tokens: 200, system: [{ type: 'text', text: 'Be brief.' }], tools,
    thinking: { type: 'enabled', budget_tokens: 100 }, metadata: { user_id: 'node-test' },
    messages: [{ role: 'user', content: `REPLY:Need the weather.[/think]Checking.${call}` }],
  };
  const { input_tokens: counted } = await client.messages.countTokens({
    model: request.model, system: request.system, tools, thinking: request.thinking, messages: request.messages });
  assert.ok(counted > 100 && counted < 900, `count_tokens: ${counted}`);
  request.max_tokens = 1024 - counted;  // the whole context of tiny-v4: the reply repeats the REPLY text

  // Whole: thinking, text and tool_use blocks.
  const msg = await client.messages.create(request);
  assert.equal(msg.type, 'message');
  assert.equal(msg.role, 'assistant');
  assert.equal(msg.model, 'tiny-v4');
  assert.match(msg.id, /^msg_/);
  assert.deepEqual(msg.content.map((b) => b.type), ['thinking', 'text', 'tool_use']);
  assert.equal(msg.content[0].thinking, 'Need the weather.');
  assert.equal(msg.content[1].text, 'Checking.');
  const use = msg.content[2];
  assert.match(use.id, /^toolu_/);
  assert.equal(use.name, 'get_weather');
  assert.deepEqual(use.input, { city: 'Paris', days: 3 });
  assert.equal(msg.stop_reason, 'tool_use');
  assert.equal(msg.stop_sequence, null);
  assert.equal(msg.usage.input_tokens, counted);
  assert.ok(msg.usage.output_tokens > 10);

  // Streamed: Anthropic's event sequence, accumulated by the SDK into the same message.
  const stream = client.messages.stream(request);
  const types = [];
  let text = '';
  let thinking = '';
  stream.on('text', (t) => { text += t; });
  stream.on('thinking', (t) => { thinking += t; });
  for await (const ev of stream) {
    if (types.at(-1) !== ev.type || ev.type !== 'content_block_delta') types.push(ev.type);
  }
  const final = await stream.finalMessage();
  assert.deepEqual(types, ['message_start',
                           'content_block_start', 'content_block_delta', 'content_block_stop',
                           'content_block_start', 'content_block_delta', 'content_block_stop',
                           'content_block_start', 'content_block_delta', 'content_block_stop',
                           'message_delta', 'message_stop']);
  assert.equal(text, 'Checking.');
  assert.equal(thinking, 'Need the weather.');
  assert.deepEqual(final.content.map((b) => b.type), ['thinking', 'text', 'tool_use']);
  assert.deepEqual(final.content[2].input, { city: 'Paris', days: 3 });
  assert.equal(final.stop_reason, 'tool_use');
  assert.equal(final.usage.input_tokens, counted);
  assert.equal(final.usage.output_tokens, msg.usage.output_tokens);

  // The tool result goes back; the next answer is text (chat mode: no thinking field).
  const next = await client.messages.create({
    model: 'tiny-v4', max_tokens: 100, tools,
    messages: [{ role: 'user', content: 'Weather in Paris?' },
               { role: 'assistant', content: [{ type: 'text', text: 'Checking.' },
                                              { type: 'tool_use', id: use.id, name: use.name, input: use.input }] },
               { role: 'user', content: [{ type: 'tool_result', tool_use_id: use.id, content: 'rain, 12 C' },
                                         { type: 'text', text: 'REPLY:It rains in Paris.' }] }],
  });
  assert.deepEqual(next.content, [{ type: 'text', text: 'It rains in Paris.' }]);
  assert.equal(next.stop_reason, 'end_turn');

  // Stop sequences.
  const stopped = await client.messages.create({
    model: 'tiny-v4', max_tokens: 50, stop_sequences: ['STOP'],
    messages: [{ role: 'user', content: 'REPLY:one two STOP three' }] });
  assert.deepEqual(stopped.content, [{ type: 'text', text: 'one two ' }]);
  assert.equal(stopped.stop_reason, 'stop_sequence');
  assert.equal(stopped.stop_sequence, 'STOP');

  // Errors: the SDK's typed errors with Anthropic's error body; the service goes on.
  await assert.rejects(client.messages.create({ model: 'tiny-v4', messages: [{ role: 'user', content: 'hi' }] }),
                       (e) => e instanceof Anthropic.BadRequestError && e.status === 400 &&
                              e.error?.type === 'error' && e.error?.error?.type === 'invalid_request_error' &&
                              /max_tokens/.test(e.message));
  await assert.rejects(client.messages.create({ ...request, tool_choice: { type: 'tool', name: 'nope' } }),
                       (e) => e instanceof Anthropic.BadRequestError && /tool_choice/.test(e.message));
  await assert.rejects(client.messages.create({ ...request, model: 'claude-x' }),
                       (e) => e instanceof Anthropic.NotFoundError && e.error?.error?.type === 'not_found_error');
  const bad = new Anthropic({ baseURL: root, apiKey: 'wrong', maxRetries: 0 });
  await assert.rejects(bad.messages.create(request),
                       (e) => e instanceof Anthropic.AuthenticationError && e.status === 401);
  const again = await client.messages.create({ model: 'tiny-v4', max_tokens: 20,
                                               messages: [{ role: 'user', content: 'REPLY:fine' }] });
  assert.deepEqual(again.content, [{ type: 'text', text: 'fine' }]);
  console.log('anthropic client: all checks passed');
}

main().catch((e) => {
  console.error('FAILED:', e);
  process.exit(1);
});
