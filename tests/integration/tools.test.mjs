// Tools through the official openai package, against the demo model served
// with Qwen3's chat template (with_qwen3_template.sh): a forced call comes
// back as tool_calls the SDK reads (whole and streamed), its arguments
// valid for the tool's parameters; the call and its result, sent back as an
// assistant tool_calls turn and a tool turn, render through the template.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { client, modelId, raw } from './client_setup.mjs';

const tools = [
  {
    type: 'function',
    function: {
      name: 'get_weather', description: 'The weather in a city now',
      parameters: {
        type: 'object',
        properties: { city: { type: 'string' }, unit: { enum: ['celsius', 'fahrenheit'] } },
        required: ['city', 'unit'], additionalProperties: false,
      },
    },
  },
  { type: 'function', function: { name: 'get_time', parameters: { type: 'object', properties: {}, additionalProperties: false } } },
];
const messages = [{ role: 'user', content: 'What is the weather in Oslo?' }];

test('a named tool_choice gives a call of that tool with valid arguments', async () => {
  const model = await modelId();
  const r = await client().chat.completions.create({
    model, messages, tools, max_tokens: 200, temperature: 0,
    tool_choice: { type: 'function', function: { name: 'get_weather' } }, parallel_tool_calls: false,
  });
  const c = r.choices[0];
  assert.equal(c.finish_reason, 'tool_calls', JSON.stringify(c));
  assert.equal(c.message.tool_calls.length, 1);
  const call = c.message.tool_calls[0];
  assert.equal(call.type, 'function');
  assert.equal(call.function.name, 'get_weather');
  const args = JSON.parse(call.function.arguments);
  assert.equal(typeof args.city, 'string');
  assert.ok(['celsius', 'fahrenheit'].includes(args.unit));
  assert.deepEqual(Object.keys(args).sort(), ['city', 'unit']);
});

test('required, streamed: the SDK assembles the calls from the deltas', async () => {
  const model = await modelId();
  const stream = await client().chat.completions.create({
    model, messages, tools, max_tokens: 300, temperature: 0.7, seed: 3, tool_choice: 'required', stream: true,
  });
  const calls = [];
  let finish = null;
  for await (const chunk of stream) {
    for (const ch of chunk.choices) {
      for (const d of ch.delta?.tool_calls ?? []) {
        calls[d.index] ??= { name: '', arguments: '' };
        if (d.function?.name) calls[d.index].name += d.function.name;
        if (d.function?.arguments) calls[d.index].arguments += d.function.arguments;
      }
      if (ch.finish_reason) finish = ch.finish_reason;
    }
  }
  if (finish === 'length') return;  // cut by max_tokens mid-call: nothing to judge
  assert.equal(finish, 'tool_calls');
  assert.ok(calls.length >= 1);
  for (const c of calls) {
    assert.ok(['get_weather', 'get_time'].includes(c.name));
    JSON.parse(c.arguments);
  }
});

test('the call and its result go back into the conversation', async () => {
  const model = await modelId();
  const first = await client().chat.completions.create({
    model, messages, tools, max_tokens: 200, temperature: 0,
    tool_choice: { type: 'function', function: { name: 'get_weather' } },
  });
  const msg = first.choices[0].message;
  const next = await client().chat.completions.create({
    model, tools, max_tokens: 16, temperature: 0,
    messages: [...messages, msg, { role: 'tool', tool_call_id: msg.tool_calls[0].id, content: '{"temp": 3}' }],
  });
  assert.equal(next.choices[0].message.role, 'assistant');
  // The template wrote the call and the result: the prompt is longer than the question alone.
  const tok = await raw('POST', '/tokenize', JSON.stringify({
    model, tools, messages: [...messages, msg, { role: 'tool', tool_call_id: msg.tool_calls[0].id, content: '{"temp": 3}' }],
  }));
  assert.equal(tok.status, 200, tok.text);
  assert.equal(next.usage.prompt_tokens, tok.json.count);
  const alone = await raw('POST', '/tokenize', JSON.stringify({ model, tools, messages }));
  assert.ok(tok.json.count > alone.json.count + 20);
});

test('the SDK\'s runTools helper calls our function with the parsed arguments', async () => {
  const model = await modelId();
  let seen = null;
  const runner = client().chat.completions.runTools({
    model, messages, max_tokens: 200, temperature: 0,
    tool_choice: { type: 'function', function: { name: 'get_weather' } },
    // The same tools as the first test (the same prompt, the same greedy call).
    tools: [{
      type: 'function',
      function: {
        name: 'get_weather', description: tools[0].function.description, parameters: tools[0].function.parameters,
        parse: JSON.parse, function: (args) => { seen = args; return '{"temp": 3}'; },
      },
    }, {
      type: 'function',
      function: { name: 'get_time', parameters: tools[1].function.parameters, parse: JSON.parse, function: () => '"noon"' },
    }],
  });
  await runner.done();
  assert.ok(seen, 'the function was called');
  assert.equal(typeof seen.city, 'string');
  assert.ok(['celsius', 'fahrenheit'].includes(seen.unit));
  const sent = runner.messages.map((m) => m.role);
  assert.deepEqual(sent.slice(-2), ['assistant', 'tool']);  // the call and its result, as the helper keeps them
});
