//! Real MCP servers behind the gateway, driven by real MCP clients.
