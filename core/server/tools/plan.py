"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice` checked and turned
into a plan (what to constrain, which parser reads the text), the prompt rendered with the tools
(or with a tool prompt when the chat template ignores them), and the per-choice streams that turn
generated text into `tool_calls`.

tool_choice:
- "none": tools are checked, then ignored (neither rendered nor called).
- a named function: the output is constrained to the function's parameters schema; the text is
  the call's arguments.
- "required": the output is constrained to a JSON array (minItems 1) of
  {"name": <one tool's name>, "parameters": <that tool's arguments>} objects, as vLLM does.
- "auto" (the default when tools are given): the chat template decides and a `tool_parser`
  plugin reads calls out of the text (--tool-call-parser, or the one that recognises the template).
See docs/tool-calling.md."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fw.chat import chat_text
from fw.errors import InvalidRequestError, UnknownImplementationError
from fw.grammar.constraint import StructuredOutputsParams
from fw.plugins.registry import Registry
from fw.plugins.specs import ToolParserSpec
from fw.server.tools.schema import check_parameters_schema
from fw.server.tools.streams import ArrayCallStream, NamedCallStream, ParserCallStream, ToolCallStream

# What fw tells a model whose chat template ignores `tools` (TGI's `tool_prompt` idea); a request may
# replace this first line with its own `tool_prompt`. The function lines and the format line follow.
TOOL_PROMPT = ("You can call the following functions. Each line describes one as JSON: its name, what it "
               "does, and its parameters as a JSON Schema.")
NAMED_FORMAT = 'Call the function "{name}": reply with only its arguments, as one JSON object.'
REQUIRED_FORMAT = ('Call one or more of these functions: reply with only a JSON array of calls, each '
                   '{"name": <function name>, "parameters": <its arguments as a JSON object>}.')
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class Function:
    """One tool of the request (OpenAI's {"type": "function", "function": {...}})."""

    name: str
    parameters: dict
    description: str | None = None

    def as_tool(self) -> dict:
        """The shape chat templates take in `tools` (HF's JSON-schema tool format)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass
class ToolPlan:
    """How one request uses its tools. `choice`: "auto", "required" or "named" ("none" makes no plan)."""

    choice: str
    functions: list[Function]
    name: str | None = None  # the named function
    parser: ToolParserSpec | None = None  # auto
    parallel: bool = True  # parallel_tool_calls: false limits required to one call
    tool_prompt: str | None = None
    tools: list[dict] = field(init=False)

    def __post_init__(self) -> None:
        self.tools = [f.as_tool() for f in self.functions]

    @property
    def constrains(self) -> bool:
        """Named and required choices constrain the output through a grammar."""
        return self.choice in ("named", "required")

    def schema(self) -> dict:
        """The JSON schema the output is constrained to (named, required)."""
        if self.choice == "named":
            return next(f.parameters for f in self.functions if f.name == self.name)
        return required_schema(self.functions, self.parallel)

    def structured_outputs(self, backend: str | None) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.schema(), backend=backend)

    def new_stream(self) -> ToolCallStream:
        """A fresh stream for one generated choice."""
        if self.choice == "named":
            return NamedCallStream(self.name)
        if self.choice == "required":
            return ArrayCallStream()
        return ParserCallStream(self.parser.factory(self.tools))

    def format_instruction(self) -> str:
        if self.choice == "named":
            return NAMED_FORMAT.format(name=self.name)
        if self.choice == "required":
            return REQUIRED_FORMAT
        return self.parser.tool_prompt_format if self.parser is not None else ""


# -- the request's tools and tool_choice --------------------------------------------------------


def plan_tools(req, parsers: Registry, parser_flag: str, chat_template: Any) -> ToolPlan | None:
    """Check `tools` and `tool_choice` and decide what to do with them; None when no tool is used."""
    functions = parse_tools(req.tools)
    choice, name = parse_tool_choice(req.tool_choice, bool(functions))
    if choice == "named" and name not in {f.name for f in functions}:
        raise InvalidRequestError(
            f"tool_choice names the function {name!r}, which is not among the request's tools "
            f"({', '.join(f.name for f in functions)})", param="tool_choice")
    if choice == "none" or not functions:
        return None
    plan = ToolPlan(choice, functions, name=name, parallel=req.parallel_tool_calls is not False,
                    tool_prompt=req.tool_prompt)
    if choice == "auto":
        plan.parser = select_tool_parser(parsers, parser_flag, template_text(chat_template))
    return plan


def parse_tools(tools: list[dict] | None) -> list[Function]:
    functions: list[Function] = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise InvalidRequestError(f"{where}: only tools of type \"function\" are supported, got {kind!r}",
                                      param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise InvalidRequestError(f'{where}: give {{"type": "function", "function": {{"name": ..., '
                                      f'"parameters": {{...}}}}}}', param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError(f"{where}.function.name must be a non-empty string", param="tools")
        if any(f.name == name for f in functions):
            raise InvalidRequestError(f"{where}: two tools are named {name!r}; tool names must be unique",
                                      param="tools")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidRequestError(f"{where}.function.description must be a string", param="tools")
        parameters = fn.get("parameters")
        if parameters is None:  # OpenAI: no parameters is a function without arguments
            parameters = {"type": "object", "properties": {}}
        check_parameters_schema(parameters, f"{where}.function.parameters")
        functions.append(Function(name, parameters, description))
    return functions


def parse_tool_choice(tool_choice: Any, has_tools: bool) -> tuple[str, str | None]:
    """("none" | "auto" | "required" | "named", the named function or None)."""
    if tool_choice is None:
        return ("auto" if has_tools else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise InvalidRequestError(f"tool_choice must be none, auto, required or "
                                      f'{{"type": "function", "function": {{"name": ...}}}}; got {tool_choice!r}',
                                      param="tool_choice")
        if tool_choice == "required" and not has_tools:
            raise InvalidRequestError('tool_choice "required" needs tools: send the functions in `tools`',
                                      param="tool_choice")
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if tool_choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
        raise InvalidRequestError('a named tool_choice is {"type": "function", "function": {"name": ...}}',
                                  param="tool_choice")
    if not has_tools:
        raise InvalidRequestError(f"tool_choice names the function {name!r} but the request has no tools: "
                                  f"send the functions in `tools`", param="tool_choice")
    return "named", name


def required_schema(functions: list[Function], parallel: bool = True) -> dict:
    """A JSON array (at least one item; at most one without parallel calls) of
    {"name": <const>, "parameters": <schema>} objects, one anyOf branch per tool (vLLM's shape).
    Each tool's `$defs`/`definitions` move to the root, where their `#/$defs/...` refs now point."""
    defs: dict[str, dict] = {}
    branches = []
    for f in functions:
        parameters = dict(f.parameters)
        for key in ("$defs", "definitions"):
            for def_name, schema in (parameters.pop(key, None) or {}).items():
                if defs.setdefault(key, {}).setdefault(def_name, schema) != schema:
                    raise InvalidRequestError(
                        f"tools: two functions define {key} {def_name!r} differently; with tool_choice "
                        f"required their definitions share one namespace, so rename one", param="tools")
        branches.append({"type": "object",
                         "properties": {"name": {"type": "string", "enum": [f.name]}, "parameters": parameters},
                         "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def check_no_other_constraint(plan: ToolPlan | None, source: str | None) -> None:
    """A named or required tool choice constrains the output itself; a second constraint cannot hold."""
    if plan is not None and plan.constrains and source is not None:
        choice = f"the named tool choice {plan.name!r}" if plan.choice == "named" else 'tool_choice "required"'
        raise InvalidRequestError(
            f"{source} cannot be combined with {choice}, which constrains the output to tool calls itself; "
            f"drop {source}, or use tool_choice auto or none", param=source)


# -- the tool-call parser (auto) ----------------------------------------------------------------


def template_text(chat_template: Any) -> str:
    """A tokenizer's chat template as text (some tokenizers keep several named templates)."""
    if isinstance(chat_template, dict):
        return "\n".join(str(t) for t in chat_template.values())
    return chat_template if isinstance(chat_template, str) else ""


def select_tool_parser(parsers: Registry, flag: str, chat_template: str) -> ToolParserSpec:
    """--tool-call-parser NAME, or (auto) the highest-priority parser that recognises the template."""
    if flag and flag != "auto":
        try:
            return parsers.get(flag)
        except UnknownImplementationError as exc:
            raise UnknownImplementationError(f"--tool-call-parser: {exc}") from None
    fits = sorted((s for s in parsers if s.detects is not None and chat_template and s.detects(chat_template)),
                  key=lambda s: (-s.priority, s.name))
    if not fits:
        installed = ", ".join(sorted(s.name for s in parsers)) or "none installed"
        raise InvalidRequestError(
            'tool_choice "auto" needs a tool-call parser to read calls out of the text, and none recognises this '
            f"model's chat template: start the server with --tool-call-parser NAME (installed: {installed}), or "
            'use tool_choice "required" or a named function, which constrain the output instead',
            param="tool_choice")
    return fits[0]


def check_tool_parser_flag(parsers: Registry, flag: str) -> None:
    """For start-up: --tool-call-parser names an installed parser (or is auto)."""
    if flag and flag != "auto":
        select_tool_parser(parsers, flag, "")


# -- messages and the prompt --------------------------------------------------------------------


def tool_message_fields(message, index: int) -> dict:
    """An OpenAI message's tool fields as chat templates take them: an assistant's `tool_calls`
    with arguments as objects (templates write them with `tojson`), a tool result's `tool_call_id`."""
    out: dict[str, Any] = {}
    if message.tool_calls:
        if message.role != "assistant":
            raise InvalidRequestError(f"messages[{index}]: only assistant messages carry tool_calls",
                                      param="messages")
        calls = []
        for j, call in enumerate(message.tool_calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequestError(
                    f'messages[{index}].tool_calls[{j}]: give {{"id": ..., "type": "function", "function": '
                    f'{{"name": ..., "arguments": "<JSON text>"}}}}', param="messages")
            args = fn.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    pass  # not JSON: the template gets the text as sent
            calls.append({"id": call.get("id"), "type": "function",
                          "function": {"name": fn["name"], "arguments": args}})
        out["tool_calls"] = calls
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def render_with_tools(tokenizer, messages: list[dict], plan: ToolPlan | None, add_generation_prompt: bool,
                      chat_template_kwargs: dict | None) -> str:
    """The prompt text: the template given `tools`; if it ignores them (same text with and without),
    the messages with a tool prompt in the system message instead (see `tool_prompt`). Text only:
    the caller bounds and tokenizes it once."""
    if plan is None:
        return chat_text(tokenizer, messages, add_generation_prompt, chat_template_kwargs)
    with_tools = chat_text(tokenizer, messages, add_generation_prompt, chat_template_kwargs, tools=plan.tools)
    without = chat_text(tokenizer, messages, add_generation_prompt, chat_template_kwargs)
    if with_tools != without:
        return with_tools
    return chat_text(tokenizer, with_tool_prompt(messages, plan), add_generation_prompt, chat_template_kwargs)


def tool_prompt(plan: ToolPlan) -> str:
    """The intro (TOOL_PROMPT or the request's `tool_prompt`), one JSON line per function, and how
    to write a call (the choice's format, or the parser's `tool_prompt_format` for auto)."""
    lines = [json.dumps(t["function"], ensure_ascii=False) for t in plan.tools]
    parts = [plan.tool_prompt or TOOL_PROMPT, "\n".join(lines)]
    instruction = plan.format_instruction()
    if instruction:
        parts.append(instruction)
    return "\n\n".join(parts)


def with_tool_prompt(messages: list[dict], plan: ToolPlan) -> list[dict]:
    """The messages with the tool prompt appended to the leading system message (or in a new one),
    and earlier assistant calls written into their turn's text, which such a template would drop."""
    prompt = tool_prompt(plan)
    out = [_calls_as_text(m) for m in messages]
    if out and out[0]["role"] in ("system", "developer"):
        first = dict(out[0])
        first["content"] = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        out[0] = first
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


def _calls_as_text(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    text = json.dumps([{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls],
                      ensure_ascii=False)
    out = dict(message)
    out["content"] = f"{message['content']}\n{text}" if message.get("content") else text
    return out


# -- sampling ------------------------------------------------------------------------------------


def constraint_field(req) -> str | None:
    """The request field that carries an output constraint of its own, if any."""
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    return next((name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                   "structured_outputs") if getattr(req, name) is not None), None)


def tool_sampling_params(req, plan: ToolPlan | None, make_params):
    """`make_params(req)` -> SamplingParams, with the tool choice's constraint when it has one
    (the request's `guided_decoding_backend` then picks the grammar backend for it)."""
    if plan is None or not plan.constrains:
        return make_params(req)
    check_no_other_constraint(plan, constraint_field(req))
    params = make_params(req.model_copy(update={"guided_decoding_backend": None}))
    params.structured_outputs = plan.structured_outputs(req.guided_decoding_backend)
    return params
