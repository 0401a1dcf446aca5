"""Tool calling on /v1/chat/completions: `plan` decides once per request how tools are rendered, constrained and
parsed (a `ToolPlan` the chat route follows), `streams` turns generated text into tool-call deltas, `schema`
checks the tools' parameter schemas. Parsers are plugins (fw.tool_parsing is their contract)."""
