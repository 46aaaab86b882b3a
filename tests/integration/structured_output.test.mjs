// Structured output through the official openai package against the running
// server (CPU worker, demo model): response_format json_schema (strict) and
// json_object, whole and streamed, chat and completions. Every answer that
// ends with finish_reason "stop" must parse and validate; the validator here
// is written apart from the server's grammar.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { client, modelId, raw } from './client_setup.mjs';

function valid(v, s, root, path = '$') {
  const fail = (why) => { throw new Error(`${path}: ${why} (${JSON.stringify(v)})`); };
  if (s.$ref) return valid(v, root.$defs[s.$ref.split('/').pop()], root, path);
  if (s.enum) { if (!s.enum.some((e) => JSON.stringify(e) === JSON.stringify(v))) fail('not in enum'); return; }
  if (s.anyOf) {
    const errors = [];
    for (const o of s.anyOf) { try { valid(v, o, root, path); return; } catch (e) { errors.push(e.message); } }
    fail('no option matches: ' + errors.join('; '));
  }
  const types = [s.type].flat();
  const typeOf = (x) => (x === null ? 'null' : Array.isArray(x) ? 'array' : Number.isInteger(x) ? 'integer' : typeof x);
  const t = typeOf(v);
  if (!types.includes(t) && !(t === 'integer' && types.includes('number'))) fail(`type ${t}, want ${types}`);
  if (t === 'object') {
    for (const r of s.required ?? []) if (!(r in v)) fail(`missing ${r}`);
    for (const [k, x] of Object.entries(v)) {
      if (s.properties?.[k]) valid(x, s.properties[k], root, `${path}.${k}`);
      else if (s.additionalProperties === false) fail(`extra property ${k}`);
    }
  }
  if (t === 'array') {
    if (s.minItems !== undefined && v.length < s.minItems) fail('too few items');
    if (s.maxItems !== undefined && v.length > s.maxItems) fail('too many items');
    v.forEach((x, i) => valid(x, s.items, root, `${path}[${i}]`));
  }
}

const order = {
  type: 'object',
  properties: {
    id: { type: 'integer' },
    customer: {
      type: 'object',
      properties: { name: { type: 'string' }, vip: { type: 'boolean' } },
      required: ['name', 'vip'], additionalProperties: false,
    },
    status: { enum: ['open', 'shipped', 'closed'] },
    total: { type: 'number' },
    lines: {
      type: 'array', minItems: 1, maxItems: 3,
      items: {
        type: 'object',
        properties: { sku: { enum: ['A1', 'B2', 'C3'] }, qty: { type: 'integer' }, note: { type: ['string', 'null'] } },
        required: ['sku', 'qty', 'note'], additionalProperties: false,
      },
    },
    parent: { anyOf: [{ type: 'null' }, { $ref: '#/$defs/ref' }] },
  },
  required: ['id', 'customer', 'status', 'total', 'lines', 'parent'],
  additionalProperties: false,
  $defs: { ref: { type: 'object', properties: { id: { type: 'integer' } }, required: ['id'], additionalProperties: false } },
};
const format = { type: 'json_schema', json_schema: { name: 'order', strict: true, schema: order } };
const messages = [{ role: 'user', content: 'Give me the order as JSON.' }];

test('json_schema: the answer parses and validates, via the SDK\'s parse()', async () => {
  const model = await modelId();
  let stopped = 0;
  for (const [temperature, seed] of [[0, 0], [0.8, 1], [1.0, 2], [1.2, 3]]) {
    let r;
    try {
      r = await client().chat.completions.parse({
        model, messages, max_tokens: 400, temperature, seed, response_format: format,
      });
    } catch (e) {
      // Cut by max_tokens: not a whole value (the SDK says so itself).
      if (/length limit/.test(e.message)) continue;
      throw e;
    }
    const c = r.choices[0];
    assert.equal(c.finish_reason, 'stop');
    stopped++;
    assert.ok(c.message.parsed, c.message.content);
    valid(c.message.parsed, order, order);
  }
  assert.ok(stopped >= 3, `${stopped} of 4 answers whole`);
});

test('json_schema streamed: the deltas join into the same valid text', async () => {
  const model = await modelId();
  const req = { model, messages, max_tokens: 400, temperature: 0.7, seed: 5, response_format: format };
  const whole = await client().chat.completions.create(req);
  const stream = await client().chat.completions.create({ ...req, stream: true });
  let text = '';
  for await (const chunk of stream) for (const c of chunk.choices) text += c.delta?.content ?? '';
  assert.equal(text, whole.choices[0].message.content);
  if (whole.choices[0].finish_reason === 'stop') valid(JSON.parse(text), order, order);
});

test('json_object: any object, also from completions', async () => {
  const model = await modelId();
  const r = await client().chat.completions.create({
    model, messages: [{ role: 'user', content: 'A config file as JSON.' }], max_tokens: 300, temperature: 0,
    response_format: { type: 'json_object' },
  });
  if (r.choices[0].finish_reason === 'stop') {
    const v = JSON.parse(r.choices[0].message.content);
    assert.equal(typeof v, 'object');
    assert.ok(!Array.isArray(v) && v !== null);
  }
  const schema = { type: 'object', properties: { ok: { type: 'boolean' }, n: { type: 'integer' } }, required: ['ok', 'n'], additionalProperties: false };
  const c = await client().completions.create({
    model, prompt: 'result = ', max_tokens: 60, temperature: 0,
    response_format: { type: 'json_schema', json_schema: { name: 'r', schema } },
  });
  assert.equal(c.choices[0].finish_reason, 'stop');
  valid(JSON.parse(c.choices[0].text), schema, schema);
});

test('a schema keyword that would not be enforced is refused by name', async () => {
  const model = await modelId();
  const body = {
    model, messages, max_tokens: 8,
    response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'string', pattern: '^a+$' } } },
  };
  const r = await raw('POST', '/v1/chat/completions', JSON.stringify(body));
  assert.equal(r.status, 400);
  assert.equal(r.json.error.param, 'response_format.json_schema.schema');
  assert.match(r.json.error.message, /'pattern'/);
  const bad = await raw('POST', '/v1/chat/completions', JSON.stringify({ ...body, response_format: { type: 'yaml' } }));
  assert.equal(bad.status, 400);
  assert.equal(bad.json.error.param, 'response_format');
});
