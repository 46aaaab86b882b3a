// Shared set-up for the integration tests: the official openai client
// pointed at the gateway that run_with_server.sh started, and a way to run
// the offline `moe` tool for the same model.
import { createRequire } from 'node:module';
import { execFileSync } from 'node:child_process';

const require = createRequire(process.env.MOE_NODE_CACHE + '/');
export const OpenAI = require('openai');

export const baseURL = process.env.MOE_BASE_URL;
export const apiKey = process.env.MOE_API_KEY;

export function client() {
  return new OpenAI({ baseURL: baseURL + '/v1', apiKey, maxRetries: 0, timeout: 120000 });
}

export async function modelId() {
  const list = await client().models.list();
  return list.data[0].id;
}

// Greedy text from the offline tool, the reference the server must equal.
export function moeGenerate(prompt, maxTokens, chat) {
  const args = ['generate', '--model', process.env.MOE_MODEL, '--prompt', prompt,
                '--max-tokens', String(maxTokens), '--temperature', '0'];
  if (chat) args.push('--chat');
  return execFileSync(process.env.MOE_CLI, args, { encoding: 'utf8', timeout: 120000 });
}

// Raw HTTP for the cases the SDK would refuse to send.
export async function raw(method, path, body, headers = {}) {
  const res = await fetch(baseURL + path, {
    method,
    headers: { authorization: 'Bearer ' + apiKey, 'content-type': 'application/json', ...headers },
    body,
  });
  const text = await res.text();
  let json = null;
  try { json = JSON.parse(text); } catch { /* not JSON */ }
  return { status: res.status, text, json, headers: res.headers };
}
