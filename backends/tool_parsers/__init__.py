"""Tool-call parsers (tool_choice auto on /v1/chat/completions); the contract is fw.tool_parsing."""
