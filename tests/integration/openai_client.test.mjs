// The official openai package against the running server: chat, streamed
// chat and completions; greedy results equal `moe generate` for the same
// prompt.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { client, modelId, moeGenerate, raw } from './client_setup.mjs';

const MAX = 24;

test('models lists the served model', async () => {
  const list = await client().models.list();
  assert.ok(list.data.length >= 1);
  assert.equal(list.data[0].object, 'model');
});

test('chat completion equals moe generate --chat', async () => {
  const model = await modelId();
  const prompt = 'Write a function that returns the sum of a list.';
  const r = await client().chat.completions.create({
    model, messages: [{ role: 'user', content: prompt }], max_tokens: MAX, temperature: 0,
  });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason));
  assert.ok(r.usage.prompt_tokens > 0);
  assert.ok(r.usage.completion_tokens > 0 && r.usage.completion_tokens <= MAX);
  assert.equal(r.choices[0].message.content, moeGenerate(prompt, MAX, true));
});

test('streamed chat completion equals the non-streamed one', async () => {
  const model = await modelId();
  const messages = [{ role: 'user', content: 'import numpy as np' }];
  const whole = await client().chat.completions.create({ model, messages, max_tokens: MAX, temperature: 0 });
  const stream = await client().chat.completions.create({
    model, messages, max_tokens: MAX, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  let text = '', finish = null, usage = null, chunks = 0;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      if (c.delta?.content) text += c.delta.content;
      if (c.finish_reason) finish = c.finish_reason;
    }
  }
  assert.ok(chunks > 2);
  assert.equal(text, whole.choices[0].message.content);
  assert.equal(finish, whole.choices[0].finish_reason);
  assert.ok(usage, 'include_usage sends a usage chunk');
  assert.equal(usage.completion_tokens, whole.usage.completion_tokens);
});

test('completion equals moe generate', async () => {
  const model = await modelId();
  const prompt = 'def fibonacci(n):\n';
  const r = await client().completions.create({ model, prompt, max_tokens: MAX, temperature: 0 });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices[0].text, moeGenerate(prompt, MAX, false));
});

test('streamed completion equals the non-streamed one', async () => {
  const model = await modelId();
  const prompt = 'class Stack:\n    def __init__(self):\n';
  const whole = await client().completions.create({ model, prompt, max_tokens: MAX, temperature: 0 });
  const stream = await client().completions.create({ model, prompt, max_tokens: MAX, temperature: 0, stream: true });
  let text = '';
  for await (const chunk of stream) for (const c of chunk.choices) text += c.text ?? '';
  assert.equal(text, whole.choices[0].text);
});

test('seeded sampling is reproducible and n gives n choices', async () => {
  const model = await modelId();
  const req = { model, prompt: 'for i in range(', max_tokens: 12, temperature: 0.9, seed: 1234, n: 3 };
  const a = await client().completions.create(req);
  const b = await client().completions.create(req);
  assert.equal(a.choices.length, 3);
  assert.deepEqual(a.choices.map((c) => c.text), b.choices.map((c) => c.text));
});

test('stop strings end the text before the stop string', async () => {
  const model = await modelId();
  const prompt = 'def add(a, b):\n';
  const free = await client().completions.create({ model, prompt, max_tokens: MAX, temperature: 0 });
  const full = free.choices[0].text;
  // Stop at the first occurrence of a two-character piece of the free text.
  const stop = full.slice(4, 6);
  const cut = full.indexOf(stop);
  const r = await client().completions.create({ model, prompt, max_tokens: MAX, temperature: 0, stop: [stop] });
  assert.equal(r.choices[0].text, full.slice(0, cut));
  assert.equal(r.choices[0].finish_reason, 'stop');
});

test('the prefix cache: a repeated long prompt comes back from the cache with the same greedy text', async () => {
  const model = await modelId();
  const system = 'You review Python code for a team that values small, well named functions. '.repeat(12);
  const messages = [{ role: 'system', content: system }, { role: 'user', content: 'def add(a, b): return a+b' }];
  const first = await client().chat.completions.create({ model, messages, max_tokens: MAX, temperature: 0 });
  const again = await client().chat.completions.create({ model, messages, max_tokens: MAX, temperature: 0 });
  assert.equal(again.choices[0].message.content, first.choices[0].message.content);
  const cached = again.usage.prompt_tokens_details?.cached_tokens ?? 0;
  assert.ok(cached >= again.usage.prompt_tokens - 32, `${cached} of ${again.usage.prompt_tokens} prompt tokens cached`);
  assert.ok(cached < again.usage.prompt_tokens);  // the last ones are computed
});

// The server's count of prompt tokens its prefix cache served, from /metrics.
async function cachedPromptTokens() {
  const m = (await raw('GET', '/metrics')).text.match(/^moe_gateway_prompt_cached_tokens_total (\d+)/m);
  assert.ok(m, 'moe_gateway_prompt_cached_tokens_total in /metrics');
  return Number(m[1]);
}

test('the n choices of a long prompt prefill it once: the others come from the prefix cache', async () => {
  // 1,000 tokens, not a multiple of the 256-token step: the first choice's
  // last chunk leaves the next choice a part of a step that is not whole KV
  // blocks. A chunk ending mid-block broke that choice's chain of cached
  // blocks, so it computed nearly the whole prompt again.
  const model = await modelId();
  const prompt = Array.from({ length: 1000 }, (_, i) => 100 + ((i * 7919) % 3000));
  const before = await cachedPromptTokens();
  const r = await client().completions.create({ model, prompt, n: 4, max_tokens: 1, temperature: 0 });
  assert.equal(r.choices.length, 4);
  const served = (await cachedPromptTokens()) - before;
  // Three choices after the first, each nearly all of the prompt.
  assert.ok(served >= 3 * 800, `${served} prompt tokens of the 3 later choices came from the cache`);
});
