// 64 concurrent streaming clients all finish; no request lost, no token
// duplicated or dropped: each stream's text equals its non-streamed twin
// under greedy decoding.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { client, modelId } from './client_setup.mjs';

const CLIENTS = 64;
const MAX = 16;

function prompts() {
  const text = fs.readFileSync(path.join(process.env.MOE_MODEL, 'eval.txt'), 'utf8');
  const lines = text.split('\n').filter((l) => l.trim().length > 8);
  const out = [];
  for (let i = 0; out.length < CLIENTS; i += 37) out.push(lines[i % lines.length] + '\n');
  return out;
}

async function streamText(model, prompt) {
  const stream = await client().completions.create({ model, prompt, max_tokens: MAX, temperature: 0, stream: true });
  let text = '', finish = null;
  for await (const chunk of stream) for (const c of chunk.choices) {
    text += c.text ?? '';
    if (c.finish_reason) finish = c.finish_reason;
  }
  return { text, finish };
}

test(`${CLIENTS} concurrent streams equal their non-streamed twins`, { timeout: 480000 }, async () => {
  const model = await modelId();
  const ps = prompts();
  const t0 = Date.now();
  const streamed = await Promise.all(ps.map((p) => streamText(model, p)));
  const seconds = (Date.now() - t0) / 1000;
  for (const s of streamed) assert.ok(s.finish === 'stop' || s.finish === 'length');
  const twins = await Promise.all(ps.map((p) =>
    client().completions.create({ model, prompt: p, max_tokens: MAX, temperature: 0 })));
  for (let i = 0; i < CLIENTS; i++) assert.equal(streamed[i].text, twins[i].choices[0].text, `client ${i}`);
  console.log(`${CLIENTS} streams of ${MAX} tokens finished in ${seconds.toFixed(1)} s`);
});
