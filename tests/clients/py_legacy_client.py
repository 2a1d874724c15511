"""Drives a legacy MCP session with the Python SDK's real client (`mcp==2.3.0`,
`Client(url, mode="legacy")`), printing one JSON object per step on stdout.

    tests/.venv/bin/python tests/clients/py_legacy_client.py URL SCENARIO

Scenarios: basic, elicit, multi, reconnect (a question after the server closed the
call's stream: the transport resumes it), sample, roots, progress, delete (the session ends with
an HTTP DELETE when the client closes), everything (against server-everything).
Exits non-zero, with the reason on stderr, when a step fails or 30 s pass.
"""

import asyncio
import json
import os
import sys
import time

import httpx2
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

START = time.monotonic()
ANSWERS = {
    "What is your name?": {"name": "Alice"},
    "Where do you want to go?": {"destination": "Lisbon"},
    "How many nights in Lisbon?": {"nights": 3},
    "Progress sent. Go on?": {"go": True},
}
seen: list[str] = []


def emit(step: str, **fields) -> None:
    fields["atMs"] = round((time.monotonic() - START) * 1000)
    print(json.dumps({"step": step, **fields}), flush=True)
    seen.append(step)


async def on_elicit(context, params: types.ElicitRequestParams) -> types.ElicitResult:
    emit("elicitation", message=params.message)
    if params.message in ANSWERS:
        return types.ElicitResult(action="accept", content=ANSWERS[params.message])
    return types.ElicitResult(action="decline")


async def on_sample(context, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
    emit("sampling", messages=len(params.messages))
    return types.CreateMessageResult(
        role="assistant", content=types.TextContent(type="text", text="short"), model="test-model", stop_reason="endTurn"
    )


async def on_roots(context) -> types.ListRootsResult:
    emit("roots")
    return types.ListRootsResult(roots=[types.Root(uri="file:///tmp/project", name="project")])


def text_of(result: types.CallToolResult) -> str:
    return " ".join(c.text for c in result.content if isinstance(c, types.TextContent))


async def call(client: Client, tool: str, args: dict | None = None, **kwargs) -> str:
    result = await client.call_tool(tool, args or {}, **kwargs)
    if result.is_error:
        raise RuntimeError(f"{tool} failed: {text_of(result)}")
    text = text_of(result)
    emit("call", tool=tool, text=text)
    return text


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


async def scenario(client: Client, name: str) -> None:
    if name == "basic":
        tools = await client.list_tools()
        emit("tools/list", tools=sorted(t.name for t in tools.tools))
        expect("5" in await call(client, "add", {"a": 2, "b": 3}), "add(2, 3) did not give 5")
    elif name == "elicit":
        expect(await call(client, "ask_name") == "Hello, Alice!", "wrong greeting")
    elif name == "multi":
        expect(await call(client, "plan_trip") == "Trip to Lisbon for 3 nights", "wrong trip")
    elif name == "reconnect":
        expect(await call(client, "ask_name_after_reconnect") == "Hello, Alice!", "wrong greeting")
    elif name == "sample":
        expect(await call(client, "summarize", {"text": "a long text"}) == "summary: short", "wrong summary")
    elif name == "roots":
        expect("file:///tmp/project" in await call(client, "show_roots"), "roots missing")
    elif name == "progress":
        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            emit("progress", progress=progress, total=total)

        await call(client, "count_progress", {"steps": 3}, progress_callback=on_progress)
        call_index = seen.index("call")
        expect(seen[:call_index].count("progress") == 3, f"progress did not all arrive before the result: {seen}")
        expect("elicitation" in seen[:call_index], f"the question did not arrive before the result: {seen}")
    elif name == "delete":
        await call(client, "add", {"a": 1, "b": 1})  # the DELETE is sent when the client closes
    elif name == "everything":
        tools = await client.list_tools()
        emit("tools/list", tools=sorted(t.name for t in tools.tools))
        await call(client, "echo", {"message": "hello from the gateway test"})
        await call(client, "trigger-elicitation-request")
        await call(client, "trigger-sampling-request", {"prompt": "hi", "maxTokens": 10})
    else:
        raise ValueError(f"unknown scenario {name}")


async def main(url: str, name: str) -> None:
    # For `delete`, the transport gets an HTTP client of ours, so the DELETE that
    # `streamable_http_client(terminate_on_close=True)` sends on close can be observed.
    deletes: list[tuple[bool, int]] = []

    async def on_response(response) -> None:
        if response.request.method == "DELETE":
            deletes.append(("mcp-session-id" in response.request.headers, response.status_code))

    # Credentials for every request (an API key, a bearer token): MCP_TEST_HEADERS, JSON.
    headers = json.loads(os.environ.get("MCP_TEST_HEADERS", "{}"))
    http = httpx2.AsyncClient(timeout=httpx2.Timeout(30.0, read=300.0), headers=headers, event_hooks={"response": [on_response]})
    own_client = name == "delete" or bool(headers)
    server = streamable_http_client(url, http_client=http, terminate_on_close=True) if own_client else url
    async with http:
        async with Client(
            server,
            mode="legacy",
            elicitation_callback=on_elicit,
            sampling_callback=on_sample,
            list_roots_callback=on_roots,
        ) as client:
            server_name = client.server_info.name if client.server_info else None
            emit("initialize", protocolVersion=client.protocol_version, serverName=server_name)
            await scenario(client, name)
        if name == "delete":
            expect(len(deletes) == 1, f"expected one DELETE, saw {deletes}")
            has_session, status = deletes[0]
            expect(has_session and (status < 300 or status == 405), f"DELETE failed: {deletes}")
            emit("delete", sessionId=has_session, status=status)


def leaves(e: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, which task groups raise."""
    if isinstance(e, BaseExceptionGroup):
        return [leaf for inner in e.exceptions for leaf in leaves(inner)]
    return [e]


if __name__ == "__main__":
    try:
        asyncio.run(asyncio.wait_for(main(sys.argv[1], sys.argv[2]), timeout=30))
    except TimeoutError:
        print("timed out after 30 s", file=sys.stderr)
        sys.exit(1)
    except BaseException as e:  # noqa: BLE001 - report any failure and exit non-zero
        for leaf in leaves(e):
            print(f"{type(leaf).__name__}: {leaf}", file=sys.stderr)
        sys.exit(1)
