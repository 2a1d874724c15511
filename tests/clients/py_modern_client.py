"""Drives 2026-07-28 flows with the Python SDK's real client (`mcp==2.3.0`,
`Client(url, mode="auto")`), printing one JSON object per step on stdout.

    tests/.venv/bin/python tests/clients/py_modern_client.py URL SCENARIO [URL2]

Scenarios: elicit, multi, two, sample, ask-and-sample, roots, getstream and getstream-multi (the
TypeScript fixture's questions on the session's GET stream), reconnect (the FastMCP
fixture's question after it closed the call's stream), everything and everything-url-roots
(server-everything's tools: URL elicitation, including its -32042 error path, and roots); the
client fulfils input requests itself. With URL2 (a second gateway replica) the client's
HTTP transport sends each request to the other of URL and URL2 in turn, as a balancer
spreading requests over replicas would, so the rounds of one call alternate replicas.
And failing: calls the tool `broken` and prints the error the client reports.
And alternate: the rounds of plan_trip are sent by hand, each to the other of URL and
URL2, with the SDK's own retry parameters.
Exits non-zero, with the reason on stderr, when a step fails or 30 s pass.

Credentials, from the environment, for every request the client makes:
MCP_TEST_HEADERS, a JSON object of headers (an API key, a bearer token); or
MCP_TEST_OAUTH=1, the SDK's own OAuth client (`OAuthClientProvider`: discovery from the
server's 401, dynamic registration, authorization code with PKCE), whose browser step is
played by following the authorization server's redirect, as a user who approves does.
With either, each HTTP exchange is printed as an `http` step (method, URL, status).
"""

import asyncio
import json
import os
import sys
from urllib.parse import parse_qs, urlparse

import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.auth import OAuthClientProvider, TokenStorage
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientInformationFull, OAuthClientMetadata, OAuthToken

ANSWERS = {
    "What is your name?": {"name": "Alice"},
    "Where do you want to go?": {"destination": "Lisbon"},
    "How many nights in Lisbon?": {"nights": 3},
    "Which color?": {"color": "red"},
    "Which size?": {"size": "M"},
}


def emit(step: str, **fields) -> None:
    print(json.dumps({"step": step, **fields}), flush=True)


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


async def on_elicit(context, params: types.ElicitRequestParams) -> types.ElicitResult:
    if getattr(params, "mode", None) == "url":
        emit("url_elicitation", url=params.url)
        return types.ElicitResult(action="accept")
    emit("elicitation", message=params.message)
    if params.message not in ANSWERS:
        return types.ElicitResult(action="decline")
    return types.ElicitResult(action="accept", content=ANSWERS[params.message])


async def on_sample(context, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
    emit("sampling")
    return types.CreateMessageResult(role="assistant", content=types.TextContent(type="text", text="short"), model="m", stop_reason="endTurn")


async def on_roots(context) -> types.ListRootsResult:
    emit("roots")
    return types.ListRootsResult(roots=[types.Root(uri="file:///tmp/project", name="project")])


def text_of(result: types.CallToolResult) -> str:
    return " ".join(c.text for c in result.content if isinstance(c, types.TextContent))


class Alternating(httpx2.AsyncBaseTransport):
    """Sends each request to the next of several origins: a request-level balancer."""

    def __init__(self, urls: list[str]) -> None:
        self.origins = [httpx2.URL(u) for u in urls]
        self.sent = 0
        self.inner = httpx2.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        first = self.origins[0]
        if (request.url.host, request.url.port) == (first.host, first.port):
            # Only the gateway's requests are spread (an authorization server is not).
            origin = self.origins[self.sent % len(self.origins)]
            self.sent += 1
            request.url = request.url.copy_with(host=origin.host, port=origin.port)
            request.headers["host"] = f"{origin.host}:{origin.port}"
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


class MemoryStorage(TokenStorage):
    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client_info: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client_info

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client_info = client_info


def oauth(url: str) -> OAuthClientProvider:
    """The SDK's OAuth client; the user approves at once."""
    redirected: dict[str, str] = {}

    async def open_browser(authorization_url: str) -> None:
        emit("authorize", url=authorization_url.split("?")[0])
        async with httpx2.AsyncClient() as browser:
            response = await browser.get(authorization_url, follow_redirects=False)
        query = parse_qs(urlparse(response.headers["location"]).query)
        redirected.update({k: v[0] for k, v in query.items()})

    async def callback() -> AuthorizationCodeResult:
        return AuthorizationCodeResult(code=redirected["code"], state=redirected.get("state"), iss=redirected.get("iss"))

    metadata = OAuthClientMetadata(
        client_name="mrtr-gateway test client",
        redirect_uris=["http://127.0.0.1:1/callback"],
        grant_types=["authorization_code", "refresh_token"],
        response_types=["code"],
    )
    return OAuthClientProvider(url, metadata, MemoryStorage(), open_browser, callback)


async def log_exchange(response: httpx2.Response) -> None:
    emit("http", method=response.request.method, url=str(response.request.url), status=response.status_code)


def client(url: str, url2: str | None = None) -> Client:
    server = url
    headers = json.loads(os.environ.get("MCP_TEST_HEADERS", "{}"))
    auth = oauth(url) if os.environ.get("MCP_TEST_OAUTH") else None
    if url2 is not None or headers or auth is not None:
        timeout = httpx2.Timeout(30, read=300)
        transport = Alternating([url, url2]) if url2 is not None else None
        hooks = {"response": [log_exchange]} if headers or auth is not None else {}
        http = httpx2.AsyncClient(transport=transport, timeout=timeout, headers=headers, auth=auth, event_hooks=hooks)
        server = streamable_http_client(url, http_client=http)
    return Client(server, mode="auto", elicitation_callback=on_elicit, sampling_callback=on_sample, list_roots_callback=on_roots)


async def automatic(url: str, tool: str, args: dict, want: str, url2: str | None = None) -> None:
    async with client(url, url2) as c:
        emit("connected", protocolVersion=c.protocol_version)
        expect(c.protocol_version == "2026-07-28", f"negotiated {c.protocol_version}, not 2026-07-28")
        result = await c.call_tool(tool, args)
        text = text_of(result)
        emit("call", tool=tool, text=text)
        expect(text == want, f"{tool} gave {text!r}, wanted {want!r}")


async def alternate(url_a: str, url_b: str) -> None:
    async with client(url_a) as a, client(url_b) as b:
        replicas = [a, b]
        responses, state, rounds = None, None, 0
        while True:
            replica = replicas[rounds % 2]
            result = await replica.session.call_tool(
                "plan_trip", {}, input_responses=responses, request_state=state, allow_input_required=True
            )
            rounds += 1
            if not isinstance(result, types.InputRequiredResult):
                text = text_of(result)
                emit("call", tool="plan_trip", text=text, rounds=rounds)
                expect(text == "Trip to Lisbon for 3 nights", f"wrong result {text!r}")
                expect(rounds == 3, f"expected 3 requests (2 rounds of questions), made {rounds}")
                return
            keys = sorted(result.input_requests or {})
            emit("input_required", replica="AB"[(rounds - 1) % 2], keys=keys, stateBytes=len(result.request_state or ""))
            responses = {}
            for key, request in (result.input_requests or {}).items():
                message = request.params.message
                responses[key] = types.ElicitResult(action="accept", content=ANSWERS[message])
            state = result.request_state


async def main(url: str, scenario: str, url2: str | None) -> None:
    if scenario == "elicit":
        await automatic(url, "ask_name", {}, "Hello, Alice!", url2)
    elif scenario == "multi":
        await automatic(url, "plan_trip", {}, "Trip to Lisbon for 3 nights", url2)
    elif scenario == "getstream":
        await automatic(url, "ask_name_get_stream", {}, "Hello, Alice!", url2)
    elif scenario == "getstream-multi":
        await automatic(url, "plan_trip_get_stream", {}, "Trip to Lisbon for 3 nights", url2)
    elif scenario == "two":
        await automatic(url, "ask_two", {}, "color=red size=M", url2)
    elif scenario == "reconnect":
        await automatic(url, "ask_name_after_reconnect", {}, "Hello, Alice!", url2)
    elif scenario == "ask-and-sample":
        await automatic(url, "ask_and_sample", {}, "name=Alice greeting=short", url2)
    elif scenario == "sample":
        await automatic(url, "summarize", {"text": "a long text"}, "summary: short", url2)
    elif scenario == "roots":
        await automatic(url, "show_roots", {}, "roots: file:///tmp/project", url2)
    elif scenario == "everything":
        async with client(url) as c:
            expect(c.protocol_version == "2026-07-28", f"negotiated {c.protocol_version}")
            for tool, args in [("echo", {"message": "hi"}), ("trigger-elicitation-request", {}), ("trigger-sampling-request", {"prompt": "hi", "maxTokens": 10})]:
                emit("call", tool=tool, text=text_of(await c.call_tool(tool, args)))
    elif scenario == "everything-url-roots":
        async with client(url) as c:
            consent = {"url": "https://example.com/consent", "message": "Open the consent page"}
            for tool, args in [("trigger-url-elicitation", consent), ("trigger-url-elicitation", {**consent, "errorPath": True}), ("get-roots-list", {})]:
                emit("call", tool=tool, text=text_of(await c.call_tool(tool, args)))
    elif scenario == "relayed":
        # Drives native_city by hand to show whose InputRequiredResult comes back.
        async with client(url) as c:
            result = await c.session.call_tool("native_city", {}, allow_input_required=True)
            expect(isinstance(result, types.InputRequiredResult), f"expected input_required, got {result}")
            keys = sorted(result.input_requests or {})
            emit("input_required", keys=keys, requestState=result.request_state)
            answers = {k: types.ElicitResult(action="accept", content={"city": "Lisbon"}) for k in keys}
            done = await c.session.call_tool("native_city", {}, input_responses=answers, request_state=result.request_state, allow_input_required=True)
            emit("call", tool="native_city", text=text_of(done))
    elif scenario == "failing":
        # The call fails upstream: print the error the client reports.
        async with client(url) as c:
            try:
                result = await c.call_tool("broken", {})
                emit("call", tool="broken", text=text_of(result))
            except Exception as e:  # noqa: BLE001 - the error is the observation
                error = getattr(e, "error", None)
                emit("error", type=type(e).__name__, code=getattr(error, "code", None), message=str(e))
    elif scenario == "alternate":
        await alternate(url, url2 or url)
    else:
        raise ValueError(f"unknown scenario {scenario}")


if __name__ == "__main__":
    try:
        args = sys.argv[1:]
        asyncio.run(asyncio.wait_for(main(args[0], args[1], args[2] if len(args) > 2 else None), timeout=30))
    except BaseException as e:  # noqa: BLE001 - report any failure and exit non-zero
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
