// Constrained output through the official openai client against `numoe serve` on demo-v4 (a model that knows
// no JSON): response_format json_schema outputs parse and validate against their schema for 50 seeds (chat,
// completions, streamed, n > 1), json_object gives an object, unsupported schema keywords are refused by
// name, and tool_choice "required" / a named function give a tool call that parses.
import assert from 'node:assert/strict';
import OpenAI from 'openai';

const [baseURL] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0, timeout: 120000 });
const model = 'demo-v4';

const schema = {
  type: 'object',
  properties: {
    name: { type: 'string', maxLength: 12 },
    age: { type: 'integer' },
    score: { type: 'number' },
    member: { type: 'boolean' },
    pet: { enum: ['cat', 'dog', 'none'] },
    tags: { type: 'array', items: { type: 'string', maxLength: 6 }, minItems: 1, maxItems: 3 },
    nickname: { anyOf: [{ type: 'string', maxLength: 8 }, { type: 'null' }] },
    home: { $ref: '#/$defs/place' },
    version: { const: 2 },
  },
  required: ['name', 'age', 'pet', 'home', 'version'],
  additionalProperties: false,
  $defs: {
    place: {
      type: 'object',
      properties: { city: { type: 'string', maxLength: 10 }, zip: { type: ['integer', 'null'] } },
      required: ['city'],
      additionalProperties: false,
    },
  },
};
const responseFormat = { type: 'json_schema', json_schema: { name: 'person', schema, strict: true } };

// A validator for the keywords the schema above uses (the server's compiler is what is under test).
function validate(s, v, root, path = '$') {
  const fail = (why) => assert.fail(`${path}: ${why} (${JSON.stringify(v)})`);
  if (s.$ref) return validate(root.$defs[s.$ref.split('/').pop()], v, root, path);
  if ('const' in s) return assert.deepEqual(v, s.const, `${path}: const`);
  if (s.enum) return s.enum.some((e) => JSON.stringify(e) === JSON.stringify(v)) || fail('not in enum');
  if (s.anyOf) {
    const ok = s.anyOf.some((alt) => { try { validate(alt, v, root, path); return true; } catch { return false; } });
    return ok || fail('matches no anyOf alternative');
  }
  const types = Array.isArray(s.type) ? s.type : s.type ? [s.type] : [];
  const typeOf = (x) => x === null ? 'null' : Array.isArray(x) ? 'array' : Number.isInteger(x) ? 'integer' : typeof x;
  const t = typeOf(v);
  if (types.length && !types.some((want) => want === t || (want === 'number' && t === 'integer'))) fail(`type ${t}`);
  if (t === 'string') {
    const n = [...v].length;
    if (s.maxLength !== undefined && n > s.maxLength) fail(`longer than ${s.maxLength}`);
  }
  if (t === 'array') {
    if (s.minItems !== undefined && v.length < s.minItems) fail('too few items');
    if (s.maxItems !== undefined && v.length > s.maxItems) fail('too many items');
    v.forEach((x, i) => validate(s.items ?? {}, x, root, `${path}[${i}]`));
  }
  if (t === 'object') {
    for (const r of s.required ?? []) if (!(r in v)) fail(`missing ${r}`);
    for (const [k, x] of Object.entries(v)) {
      if (!(k in (s.properties ?? {}))) {
        if (s.additionalProperties === false) fail(`extra property ${k}`);
        continue;
      }
      validate(s.properties[k], x, root, `${path}.${k}`);
    }
  }
  return true;
}

const messages = [{ role: 'user', content: 'Describe a person.' }];

async function main() {
  // 1. json_schema on chat: 50 seeds at temperature 1, each parses and validates, and stops (not truncated).
  const seeds = Array.from({ length: 50 }, (_, i) => i);
  for (let at = 0; at < seeds.length; at += 10) {
    const batch = seeds.slice(at, at + 10);
    const rs = await Promise.all(batch.map((seed) => client.chat.completions.create({
      model, messages, response_format: responseFormat, temperature: 1.0, seed, max_tokens: 600 })));
    rs.forEach((r, i) => {
      const c = r.choices[0];
      assert.equal(c.finish_reason, 'stop', `seed ${batch[i]}: ${c.message.content}`);
      let v;
      assert.doesNotThrow(() => { v = JSON.parse(c.message.content); }, `seed ${batch[i]}: ${c.message.content}`);
      validate(schema, v, schema);
    });
  }

  // 2. Completions, streamed, and n = 3: every choice valid.
  {
    const stream = await client.completions.create({ model, prompt: 'JSON:', response_format: responseFormat,
                                                     temperature: 1.0, seed: 7, n: 3, max_tokens: 600, stream: true });
    const text = ['', '', ''];
    const finish = [];
    for await (const chunk of stream) {
      for (const ch of chunk.choices) {
        text[ch.index] += ch.text;
        if (ch.finish_reason) finish[ch.index] = ch.finish_reason;
      }
    }
    assert.deepEqual(finish, ['stop', 'stop', 'stop'], text.join('\n'));
    for (const t of text) validate(schema, JSON.parse(t), schema);
    assert.ok(new Set(text).size >= 2, 'the choices are independent samples');
  }

  // 3. json_object: an object; greedy and a low temperature too.
  for (const temperature of [0, 0.3]) {
    const r = await client.chat.completions.create({ model, messages, response_format: { type: 'json_object' },
                                                     temperature, seed: 3, max_tokens: 600 });
    const c = r.choices[0];
    if (c.finish_reason === 'stop') {
      const v = JSON.parse(c.message.content);
      assert.equal(typeof v, 'object');
      assert.ok(v !== null && !Array.isArray(v));
    } else {
      assert.ok(c.message.content.startsWith('{'), c.message.content);  // an unbounded object may run out of tokens
    }
  }

  // 4. Unsupported schema features are refused by name.
  for (const [bad, word] of [[{ type: 'string', pattern: 'a+' }, "'pattern'"],
                             [{ type: 'object', properties: { x: { type: 'integer', minimum: 1 } } }, "'minimum'"],
                             [{ oneOf: [{ type: 'string' }] }, "'oneOf'"]]) {
    await assert.rejects(client.chat.completions.create({
      model, messages, max_tokens: 4,
      response_format: { type: 'json_schema', json_schema: { name: 'x', schema: bad } } }),
    (e) => e.status === 400 && e.message.includes(word) && e.param === 'response_format.json_schema.schema');
  }
  await assert.rejects(client.chat.completions.create({ model, messages, max_tokens: 4,
                                                        response_format: { type: 'yaml' } }),
                       (e) => e.status === 400 && e.param === 'response_format.type');

  // 5. Forced tool calls: "required" and a named function; arguments parse and follow the parameters.
  const tools = [
    { type: 'function', function: { name: 'get_weather', description: 'Weather for a city',
      parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 12 }, days: { type: 'integer' } },
                    required: ['city', 'days'] } } },
    { type: 'function', function: { name: 'get_time', description: 'The time in a zone',
      parameters: { type: 'object', properties: { zone: { type: 'string', enum: ['UTC', 'CET'] } },
                    required: ['zone'] } } },
  ];
  for (const seed of [1, 2, 3, 4, 5]) {
    for (const tool_choice of ['required', { type: 'function', function: { name: 'get_time' } }]) {
      const r = await client.chat.completions.create({ model, messages, tools, tool_choice, temperature: 1.0, seed,
                                                       max_tokens: 400 });
      const c = r.choices[0];
      assert.equal(c.finish_reason, 'tool_calls', JSON.stringify(c.message));
      assert.equal(c.message.tool_calls.length, 1);
      const call = c.message.tool_calls[0].function;
      if (typeof tool_choice === 'object') assert.equal(call.name, 'get_time');
      const args = JSON.parse(call.arguments);
      if (call.name === 'get_weather') {
        assert.equal(typeof args.city, 'string');
        assert.ok(Number.isInteger(args.days), call.arguments);
      } else {
        assert.equal(call.name, 'get_time');
        assert.ok(['UTC', 'CET'].includes(args.zone), call.arguments);
      }
    }
  }
  await assert.rejects(client.chat.completions.create({ model, messages, tools, max_tokens: 4,
                                                        tool_choice: { type: 'function', function: { name: 'nope' } } }),
                       (e) => e.status === 400 && e.param === 'tool_choice.function.name');
  await assert.rejects(client.chat.completions.create({ model, messages, max_tokens: 4, tool_choice: 'required' }),
                       (e) => e.status === 400 && e.param === 'tool_choice');
  console.log('structured_test: ok');
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
