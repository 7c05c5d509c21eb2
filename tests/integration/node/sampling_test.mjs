// Sampling features through the official openai client against `numoe serve` on tiny-v4 (real CPU backend):
// logprobs equal log-softmax of the golden logits for the greedy tokens of every golden prompt (completions
// and chat, streamed and not), n choices reproducible with a seed, and each penalty, logit_bias and min_p
// changing the greedy output exactly as recomputed here from the golden logits.
import assert from 'node:assert/strict';
import fs from 'node:fs';
import OpenAI from 'openai';

const [baseURL, goldenPath] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey: 'unused', maxRetries: 0 });
const model = 'tiny-v4';
const TOL = 2e-3;

// golden.safetensors (tests/data/README.md): pK.input_ids I64 [S], pK.greedy_tokens I64 [32],
// pK.greedy_step_logits F32 [32, V].
function loadGoldens(path) {
  const buf = fs.readFileSync(path);
  const n = Number(buf.readBigUInt64LE(0));
  const header = JSON.parse(buf.subarray(8, 8 + n).toString('utf8'));
  const tensor = (name) => {
    const t = header[name];
    const [a, b] = t.data_offsets;
    const bytes = buf.subarray(8 + n + a, 8 + n + b);
    const copy = new Uint8Array(bytes).buffer;  // aligned
    if (t.dtype === 'F32') return { shape: t.shape, data: new Float32Array(copy) };
    if (t.dtype === 'I64') return { shape: t.shape, data: Array.from(new BigInt64Array(copy), Number) };
    throw new Error(`${name}: dtype ${t.dtype}`);
  };
  const out = [];
  for (let k = 0; header[`p${k}.input_ids`]; ++k) {
    const logits = tensor(`p${k}.greedy_step_logits`);
    const V = logits.shape[1];
    const rows = [];
    for (let i = 0; i < logits.shape[0]; ++i) rows.push(Array.from(logits.data.subarray(i * V, (i + 1) * V)));
    out.push({ name: `p${k}`, ids: tensor(`p${k}.input_ids`).data, greedy: tensor(`p${k}.greedy_tokens`).data, rows });
  }
  return out;
}

function logSoftmax(row) {
  const m = Math.max(...row);
  const lse = m + Math.log(row.reduce((s, x) => s + Math.exp(x - m), 0));
  return row.map((x) => x - lse);
}
function argmax(row) {
  let best = 0;
  for (let i = 1; i < row.length; ++i) if (row[i] > row[best]) best = i;
  return best;
}
function topN(row, n) {
  return row.map((x, i) => [x, i]).sort((a, b) => b[0] - a[0] || a[1] - b[1]).slice(0, n).map((p) => p[1]);
}
const near = (a, b, what) => assert.ok(Math.abs(a - b) <= TOL, `${what}: ${a} vs ${b}`);

// Greedy on golden prompt g with the given penalties, recomputed from the golden logits while the output
// follows the golden greedy tokens (afterwards the model's logits are no longer the goldens'): returns the
// expected tokens up to and including the first one that differs from the golden greedy token.
function expectedPenalized(g, { frequency = 0, presence = 0, repetition = 1, bias = {} }) {
  const out = [];
  const counts = new Map();
  const seen = new Set(g.ids);
  for (let k = 0; k < g.rows.length; ++k) {
    const l = g.rows[k].slice();
    for (const [t, b] of Object.entries(bias)) l[Number(t)] += b;
    if (repetition !== 1) {
      for (const t of new Set([...seen, ...counts.keys()])) l[t] = l[t] > 0 ? l[t] / repetition : l[t] * repetition;
    }
    for (const [t, c] of counts) l[t] -= frequency * c + presence;
    const tok = argmax(l);
    out.push(tok);
    if (tok !== g.greedy[k]) return out;
    counts.set(tok, (counts.get(tok) ?? 0) + 1);
  }
  return out;
}

async function complete(body) {
  return client.completions.create({ model, temperature: 0, ignore_eos: true, return_token_ids: true, ...body });
}

async function main() {
  const goldens = loadGoldens(goldenPath);
  assert.equal(goldens.length, 4);

  // 1. Completions logprobs: chosen and top-5 equal log-softmax of the golden step logits, every prompt.
  for (const g of goldens) {
    const r = await complete({ prompt: g.ids, max_tokens: g.greedy.length, logprobs: 5 });
    const c = r.choices[0];
    assert.deepEqual(c.token_ids, g.greedy, `${g.name}: greedy tokens`);
    const lp = c.logprobs;
    assert.equal(lp.token_logprobs.length, g.greedy.length);
    assert.equal(lp.tokens.length, g.greedy.length);
    assert.equal(lp.text_offset.length, g.greedy.length);
    for (let t = 0; t < g.greedy.length; ++t) {
      const ref = logSoftmax(g.rows[t]);
      near(lp.token_logprobs[t], ref[g.greedy[t]], `${g.name} step ${t} chosen`);
      // A JSON object has no order: compare the values most likely first.
      const top = Object.values(lp.top_logprobs[t]).sort((x, y) => y - x);
      const want = topN(g.rows[t], 5);
      assert.equal(top.length, 5, `${g.name} step ${t}: top_logprobs has 5 entries`);
      for (let j = 0; j < 5; ++j) near(top[j], ref[want[j]], `${g.name} step ${t} top ${j}`);
    }
    for (let t = 1; t < lp.text_offset.length; ++t) assert.ok(lp.text_offset[t] >= lp.text_offset[t - 1]);
  }

  // The same in stream chunks (one prompt), and top 20 (beyond OpenAI's 5, as vLLM allows).
  {
    const g = goldens[0];
    const stream = await complete({ prompt: g.ids, max_tokens: 8, logprobs: 20, stream: true });
    const got = [];
    const tops = [];
    for await (const chunk of stream) {
      for (const ch of chunk.choices) {
        if (!ch.logprobs) continue;
        got.push(...ch.logprobs.token_logprobs);
        tops.push(...ch.logprobs.top_logprobs);
      }
    }
    assert.equal(got.length, 8);
    for (let t = 0; t < 8; ++t) {
      const ref = logSoftmax(g.rows[t]);
      near(got[t], ref[g.greedy[t]], `stream step ${t}`);
      const values = Object.values(tops[t]).sort((x, y) => y - x);
      assert.equal(values.length, 20);
      const want = topN(g.rows[t], 20);
      for (let j = 0; j < 20; ++j) near(values[j], ref[want[j]], `stream step ${t} top ${j}`);
    }
    await assert.rejects(complete({ prompt: g.ids, max_tokens: 2, logprobs: 21 }),
                         (e) => e.status === 400 && e.param === 'logprobs');
  }

  // 2. Chat logprobs (OpenAI's shape): chosen = top[0] under greedy, top sorted, bytes match, streamed =
  // not streamed; the chosen ids come back as token_ids, so the values are checked against a completions
  // request over the same ids.
  {
    const messages = [{ role: 'user', content: 'Hello' }];
    const whole = await client.chat.completions.create({ model, messages, max_tokens: 6, temperature: 0,
                                                         ignore_eos: true, logprobs: true, top_logprobs: 3 });
    const content = whole.choices[0].logprobs.content;
    assert.equal(content.length, 6);
    for (const e of content) {
      assert.equal(typeof e.token, 'string');
      assert.ok(Array.isArray(e.bytes));
      assert.equal(e.top_logprobs.length, 3);
      near(e.logprob, e.top_logprobs[0].logprob, 'greedy chooses the most likely');
      for (let j = 1; j < 3; ++j) assert.ok(e.top_logprobs[j].logprob <= e.top_logprobs[j - 1].logprob);
      assert.ok(e.logprob <= 0);
    }
    assert.equal(whole.choices[0].logprobs.refusal, null);
    const stream = await client.chat.completions.create({ model, messages, max_tokens: 6, temperature: 0,
                                                          ignore_eos: true, logprobs: true, top_logprobs: 3,
                                                          stream: true });
    const streamed = [];
    for await (const chunk of stream) {
      for (const ch of chunk.choices) if (ch.logprobs) streamed.push(...ch.logprobs.content);
    }
    assert.equal(streamed.length, 6);
    for (let t = 0; t < 6; ++t) {
      assert.deepEqual(streamed[t].bytes, content[t].bytes);
      near(streamed[t].logprob, content[t].logprob, `chat stream step ${t}`);
    }
    await assert.rejects(client.chat.completions.create({ model, messages, max_tokens: 2, top_logprobs: 3 }),
                         (e) => e.status === 400 && e.param === 'top_logprobs');
    await assert.rejects(client.chat.completions.create({ model, messages, max_tokens: 2, logprobs: true,
                                                          top_logprobs: 21 }),
                         (e) => e.status === 400 && e.param === 'top_logprobs');
  }

  // 3. n: 3 choices indexed 0..2, reproducible with a seed, choice 0 = the n=1 request, usage counts all.
  {
    const g = goldens[0];
    const body = { prompt: g.ids, max_tokens: 8, temperature: 1.0, seed: 1234, n: 3 };
    const a = await complete(body);
    const b = await complete(body);
    assert.equal(a.choices.length, 3);
    assert.deepEqual(a.choices.map((c) => c.index), [0, 1, 2]);
    assert.deepEqual(a.choices.map((c) => c.token_ids), b.choices.map((c) => c.token_ids), 'same seed, same choices');
    const texts = new Set(a.choices.map((c) => JSON.stringify(c.token_ids)));
    assert.ok(texts.size >= 2, 'independent samples differ');
    assert.equal(a.usage.completion_tokens, 24);
    assert.equal(a.usage.prompt_tokens, g.ids.length);
    const one = await complete({ ...body, n: 1 });
    assert.deepEqual(one.choices[0].token_ids, a.choices[0].token_ids, 'choice 0 samples with the seed itself');
    const stream = await complete({ ...body, stream: true, stream_options: { include_usage: true } });
    const got = [[], [], []];
    let usage = null;
    for await (const chunk of stream) {
      if (chunk.usage) usage = chunk.usage;
      for (const ch of chunk.choices) got[ch.index].push(...(ch.token_ids ?? []));
    }
    assert.deepEqual(got, a.choices.map((c) => c.token_ids), 'streamed choices = whole ones');
    assert.equal(usage.completion_tokens, 24);
    const chat = await client.chat.completions.create({ model, messages: [{ role: 'user', content: 'Hi' }],
                                                        max_tokens: 4, temperature: 1.0, seed: 5, n: 2,
                                                        ignore_eos: true });
    assert.deepEqual(chat.choices.map((c) => c.index), [0, 1]);
    assert.equal(chat.usage.completion_tokens, 8);
    await assert.rejects(complete({ prompt: g.ids, max_tokens: 2, n: 17 }), (e) => e.status === 400 && e.param === 'n');
  }

  // 4. Penalties, greedy: each one's first effect is exactly the argmax of the penalised golden logits.
  {
    const g = goldens[2];  // prompt [BOS]; its greedy continuation repeats 330 and 307
    const cases = [
      { body: { frequency_penalty: 2.0 }, p: { frequency: 2.0 } },
      { body: { presence_penalty: 2.0 }, p: { presence: 2.0 } },
      { body: { frequency_penalty: 0.8, presence_penalty: 0.8 }, p: { frequency: 0.8, presence: 0.8 } },
      { body: { repetition_penalty: 2.0 }, p: { repetition: 2.0 } },
    ];
    const repeats = (toks) => toks.length - new Set(toks).size;
    for (const { body, p } of cases) {
      const r = await complete({ prompt: g.ids, max_tokens: 32, ...body });
      const got = r.choices[0].token_ids;
      const want = expectedPenalized(g, p);
      assert.ok(want.length < 32 || want[31] !== g.greedy[31], `${JSON.stringify(body)} changes the greedy output`);
      assert.deepEqual(got.slice(0, want.length), want, `${JSON.stringify(body)}: first ${want.length} tokens`);
      if (p.frequency || p.presence) {
        assert.ok(repeats(got) < repeats(g.greedy), `${JSON.stringify(body)}: fewer repeats (${repeats(got)})`);
      }
    }
    // Out of range: named with its range.
    await assert.rejects(complete({ prompt: g.ids, max_tokens: 2, frequency_penalty: 2.5 }),
                         (e) => e.status === 400 && e.param === 'frequency_penalty' && /\[-2, 2\]/.test(e.message));
    await assert.rejects(complete({ prompt: g.ids, max_tokens: 2, repetition_penalty: 0 }),
                         (e) => e.status === 400 && e.param === 'repetition_penalty');
    await assert.rejects(complete({ prompt: g.ids, max_tokens: 2, min_p: 1.5 }),
                         (e) => e.status === 400 && e.param === 'min_p');
  }

  // 5. logit_bias: -100 on the greedy token picks the runner-up; +100 on a token forces it every step.
  for (const g of goldens) {
    const first = g.greedy[0];
    const banned = await complete({ prompt: g.ids, max_tokens: 3, logit_bias: { [first]: -100 } });
    const want = expectedPenalized(g, { bias: { [first]: -100 } });
    assert.equal(banned.choices[0].token_ids[0], want[0], `${g.name}: runner-up`);
    assert.notEqual(banned.choices[0].token_ids[0], first);
    const forced = await complete({ prompt: g.ids, max_tokens: 5, logit_bias: { 77: 100 } });
    assert.deepEqual(forced.choices[0].token_ids, [77, 77, 77, 77, 77], `${g.name}: forced`);
    // Log-probs stay those of the raw logits, not of the biased ones.
    const lp = await complete({ prompt: g.ids, max_tokens: 1, logit_bias: { 77: 100 }, logprobs: 0 });
    near(lp.choices[0].logprobs.token_logprobs[0], logSoftmax(g.rows[0])[77], `${g.name}: raw log-prob of 77`);
  }
  await assert.rejects(complete({ prompt: [0], max_tokens: 2, logit_bias: { 5000: 1 } }),
                       (e) => e.status === 400 && e.param === 'logit_bias');
  await assert.rejects(complete({ prompt: [0], max_tokens: 2, logit_bias: { 5: 101 } }),
                       (e) => e.status === 400 && e.param === 'logit_bias' && /\[-100, 100\]/.test(e.message));

  // 6. min_p = 1 keeps only the most likely token: sampling at temperature 1.5 gives the greedy tokens.
  for (const g of goldens) {
    const r = await complete({ prompt: g.ids, max_tokens: 12, temperature: 1.5, seed: 3, min_p: 1.0 });
    assert.deepEqual(r.choices[0].token_ids, g.greedy.slice(0, 12), `${g.name}: min_p 1`);
  }

  console.log('openai client against numoe serve: sampling checks passed');
}

main().catch((e) => {
  console.error('FAILED:', e);
  process.exit(1);
});
