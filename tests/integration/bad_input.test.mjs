// Bad input gets a 4xx JSON error in OpenAI's shape, and the server keeps
// serving afterwards.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';
import { baseURL, client, modelId, raw } from './client_setup.mjs';

function assertOpenAIError(r, status) {
  assert.equal(r.status, status, `expected ${status}, got ${r.status}: ${r.text}`);
  assert.ok(r.json && r.json.error, `error body in OpenAI's shape: ${r.text}`);
  assert.equal(typeof r.json.error.message, 'string');
  assert.ok(r.json.error.message.length > 0);
  assert.equal(typeof r.json.error.type, 'string');
}

async function stillServes() {
  const model = await modelId();
  const r = await client().completions.create({ model, prompt: 'x = ', max_tokens: 2, temperature: 0 });
  assert.equal(r.choices.length, 1);
}

const chat = (obj) => raw('POST', '/v1/chat/completions', JSON.stringify(obj));

test('malformed JSON is 400', async () => {
  assertOpenAIError(await raw('POST', '/v1/chat/completions', '{"model": "x", "messages": ['), 400);
  await stillServes();
});

test('wrong types and missing fields are 400', async () => {
  const model = await modelId();
  assertOpenAIError(await chat({ model, messages: 'hello' }), 400);
  assertOpenAIError(await chat({ model, messages: [{ role: 'user', content: 'hi' }], temperature: 'hot' }), 400);
  assertOpenAIError(await chat({ model, messages: [{ role: 'user', content: 'hi' }], max_tokens: 1.5 }), 400);
  assertOpenAIError(await chat({ model }), 400);
  assertOpenAIError(await raw('POST', '/v1/completions', JSON.stringify({ model })), 400);
  assertOpenAIError(await raw('POST', '/v1/chat/completions', '[1, 2, 3]'), 400);
  await stillServes();
});

test('unknown model is 404', async () => {
  assertOpenAIError(await chat({ model: 'no-such-model', messages: [{ role: 'user', content: 'hi' }] }), 404);
});

test('max_tokens <= 0 or past the context is 400', async () => {
  const model = await modelId();
  const messages = [{ role: 'user', content: 'hi' }];
  assertOpenAIError(await chat({ model, messages, max_tokens: 0 }), 400);
  assertOpenAIError(await chat({ model, messages, max_tokens: -5 }), 400);
  assertOpenAIError(await chat({ model, messages, max_tokens: 10000000 }), 400);
  await stillServes();
});

test('a body over the limit is 413', async () => {
  const model = await modelId();
  const big = 'a'.repeat(4 * 1024 * 1024);
  const r = await chat({ model, messages: [{ role: 'user', content: big }] }).catch((e) => ({ status: 413, text: String(e), json: { error: { message: 'connection closed', type: 'x' } } }));
  assertOpenAIError(r, 413);
  await stillServes();
});

test('invalid UTF-8 is 400', async () => {
  const model = await modelId();
  const head = Buffer.from(`{"model": "${model}", "messages": [{"role": "user", "content": "`);
  const tail = Buffer.from('"}]}');
  const body = Buffer.concat([head, Buffer.from([0xff, 0xfe, 0xc3]), tail]);
  assertOpenAIError(await raw('POST', '/v1/chat/completions', body), 400);
  await stillServes();
});

test('missing or wrong API key is 401, /health needs none', async () => {
  const r = await fetch(baseURL + '/v1/models', { headers: { authorization: 'Bearer wrong' } });
  assert.equal(r.status, 401);
  const h = await fetch(baseURL + '/health');
  assert.equal(h.status, 200);
});

test('unknown route is 404', async () => {
  assertOpenAIError(await raw('GET', '/v1/nothing-here'), 404);
});

test('headers that never end are cut off, and the server keeps serving', async () => {
  const url = new URL(baseURL);
  const closed = await new Promise((resolve) => {
    const sock = net.connect(Number(url.port), url.hostname, () => {
      sock.write('POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ');
      // Keep sending header bytes, never the blank line, until the server
      // closes or answers; bounded to 40 s.
      let n = 0;
      const timer = setInterval(() => { if (n++ < 400) sock.write('a'.repeat(64)); }, 100);
      const done = (v) => { clearInterval(timer); sock.destroy(); resolve(v); };
      let got = '';
      sock.on('data', (d) => { got += d; });
      sock.on('close', () => done({ closed: true, got }));
      sock.on('error', () => done({ closed: true, got }));
      setTimeout(() => done({ closed: false, got }), 40000);
    });
  });
  assert.ok(closed.closed, 'the server closed a connection whose headers never end');
  if (closed.got) assert.match(closed.got, /^HTTP\/1\.1 4(08|31)/);
  await stillServes();
});

test('numbers past a double and deep nesting are 400, and the server keeps serving', async () => {
  const model = await modelId();
  const msgs = '[{"role":"user","content":"hi"}]';
  for (const extra of ['"max_tokens":1e400', '"temperature":-1e999', `"seed":${'9'.repeat(400)}`]) {
    assertOpenAIError(await raw('POST', '/v1/chat/completions', `{"model":"${model}","messages":${msgs},${extra}}`), 400);
  }
  const deep = '['.repeat(200000) + ']'.repeat(200000);
  const r = await raw('POST', '/v1/chat/completions',
                      `{"model":"${model}","session_id":"new","messages":[{"role":"user","content":${deep}}]}`);
  assertOpenAIError(r, 400);
  assert.equal(r.json.error.code, 'nesting_too_deep');
  await stillServes();
});

test('max_tokens near 2^63 and n x max_tokens past the bound are 400', async () => {
  const model = await modelId();
  const messages = [{ role: 'user', content: 'hi' }];
  const huge = await raw('POST', '/v1/chat/completions',
                         `{"model":"${model}","messages":[{"role":"user","content":"hi"}],"max_tokens":9223372036854775000}`);
  assertOpenAIError(huge, 400);
  assert.equal(huge.json.error.code, 'context_length_exceeded');
  const costly = await chat({ model, messages, n: 128, logprobs: true, top_logprobs: 20 });
  assertOpenAIError(costly, 400);
  assert.equal(costly.json.error.code, 'request_too_costly');
  await stillServes();
});

test('without the key an unknown route is 401, not 404', async () => {
  const r = await fetch(baseURL + '/v1/nothing-here');
  assert.equal(r.status, 401);
  const s = await fetch(baseURL + '/.git/config', { headers: { authorization: 'Bearer wrong' } });
  assert.equal(s.status, 401);
});
