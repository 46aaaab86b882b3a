// Sampling controls through the official openai package against the running
// server (CPU worker, demo model), each judged by something the kernels do
// not compute: the raw log probabilities the server reports, the tokenizer's
// ids, or the greedy text.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { client, modelId, raw } from './client_setup.mjs';

const MAX = 32;
const key = (entry) => JSON.stringify(entry.bytes);

async function oneToken(text) {
  const r = await raw('POST', '/tokenize', JSON.stringify({ model: await modelId(), prompt: text }));
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.tokens.length, 1, `${JSON.stringify(text)} is one token`);
  return r.json.tokens[0];
}

test('frequency and presence penalties choose what the raw log probabilities say', async () => {
  const model = await modelId();
  const messages = [{ role: 'user', content: 'Write a Python function that prints the numbers 1 to 10.' }];
  const base = { model, messages, max_tokens: MAX, temperature: 0, logprobs: true, top_logprobs: 20 };
  const plain = await client().chat.completions.create(base);
  const freq = 0.9, pres = 0.6;
  const r = await client().chat.completions.create({ ...base, frequency_penalty: freq, presence_penalty: pres });
  const steps = r.choices[0].logprobs.content;
  assert.ok(steps.length >= 8);
  const counts = new Map();
  let judged = 0;
  for (const s of steps) {
    // The reference: the raw top 20 less the penalties of the text so far.
    const scored = s.top_logprobs.map((t) => {
      const c = counts.get(key(t)) ?? 0;
      return { k: key(t), v: t.logprob - freq * c - (c > 0 ? pres : 0) };
    }).sort((a, b) => b.v - a.v);
    const floor = Math.min(...s.top_logprobs.map((t) => t.logprob));
    // Decidable when no token outside the list can beat the best (penalties
    // only lower a logit) and the best is not a near tie.
    if (scored[0].v > floor + 1e-3 && scored[0].v - scored[1].v > 1e-3) {
      assert.equal(key(s), scored[0].k, `step ${judged}: the penalised best of the raw top 20`);
      judged++;
    }
    counts.set(key(s), (counts.get(key(s)) ?? 0) + 1);
  }
  assert.ok(judged >= steps.length / 2, `${judged} of ${steps.length} steps decidable`);
  assert.notEqual(r.choices[0].message.content, plain.choices[0].message.content, 'the penalties changed the text');
});

test('logit_bias +100 makes one token every token; -100 on the greedy first token moves it', async () => {
  const model = await modelId();
  const id = await oneToken(' return');
  const prompt = 'def f(x):\n';
  const r = await client().completions.create({ model, prompt, max_tokens: 8, temperature: 0, logit_bias: { [id]: 100 } });
  assert.equal(r.choices[0].text, ' return'.repeat(8));
  const free = await client().completions.create({ model, prompt, max_tokens: 1, temperature: 0, logprobs: 2 });
  const first = free.choices[0].logprobs.tokens[0];
  const firstId = await oneToken(first);
  const moved = await client().completions.create({
    model, prompt, max_tokens: 1, temperature: 0, logprobs: 2, logit_bias: { [firstId]: -100 },
  });
  // The raw second choice, as the free run's alternatives rank it.
  const second = Object.entries(free.choices[0].logprobs.top_logprobs[0]).sort((a, b) => b[1] - a[1])[1][0];
  assert.equal(moved.choices[0].logprobs.tokens[0], second);
  // Log probabilities stay the raw model's.
  assert.ok(Math.abs(moved.choices[0].logprobs.token_logprobs[0] - free.choices[0].logprobs.top_logprobs[0][second]) < 1e-4);
});

test('min_p 1 keeps only the best token: a hot seeded draw equals greedy', async () => {
  const model = await modelId();
  const prompt = 'import os\nimport sys\n';
  const greedy = await client().completions.create({ model, prompt, max_tokens: MAX, temperature: 0 });
  const hot = await client().completions.create({ model, prompt, max_tokens: MAX, temperature: 1.8, seed: 7, min_p: 1.0 });
  assert.equal(hot.choices[0].text, greedy.choices[0].text);
  // And min_p 0.3: every drawn token is at least 0.3 x as likely as the best one (at temperature 1).
  const r = await client().completions.create({ model, prompt, max_tokens: MAX, temperature: 1.0, seed: 11, min_p: 0.3, logprobs: 5 });
  const lp = r.choices[0].logprobs;
  for (let i = 0; i < lp.tokens.length; i++) {
    const best = Math.max(...Object.values(lp.top_logprobs[i]));
    assert.ok(lp.token_logprobs[i] >= best + Math.log(0.3) - 1e-4, `token ${i}: ${lp.token_logprobs[i]} vs best ${best}`);
  }
});

test('min_tokens bans the stop ids until that many tokens came', async () => {
  const model = await modelId();
  const nl = await oneToken('\n');
  const prompt = 'x = 1\ny = 2\n';
  const early = await client().completions.create({ model, prompt, max_tokens: MAX, temperature: 0, stop_token_ids: [nl] });
  assert.equal(early.choices[0].finish_reason, 'stop');
  const n = early.usage.completion_tokens;  // the newline included
  const late = await client().completions.create({
    model, prompt, max_tokens: MAX, temperature: 0, stop_token_ids: [nl], min_tokens: n + 2, logprobs: 1,
  });
  assert.ok(late.usage.completion_tokens > n + 2, `${late.usage.completion_tokens} tokens`);
  assert.ok(!late.choices[0].logprobs.tokens.slice(0, n + 2).includes('\n'));
});

test('repetition_penalty changes greedy text and stays reproducible', async () => {
  const model = await modelId();
  const req = { model, prompt: 'for i in range(10):\n    print(i)\nfor i in range(10):\n', max_tokens: MAX, temperature: 0 };
  const plain = await client().completions.create(req);
  const a = await client().completions.create({ ...req, repetition_penalty: 1.5 });
  const b = await client().completions.create({ ...req, repetition_penalty: 1.5 });
  assert.equal(a.choices[0].text, b.choices[0].text);
  assert.notEqual(a.choices[0].text, plain.choices[0].text);
});
