"""What a caller asks a reply to be, in OpenAI's words: `tool_choice` and `response_format`.

The LangGraph adapter and `agentcache serve` read both fields here, so one request means the same
on every way in. `tool_choice` becomes None (the model decides), "none", "required" or a tool's
name (`toolcalls.ToolFormat.constraint` turns a forced choice into a grammar); `response_format`
becomes an `OutputConstraint` or None.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

from agentcache.engine.grammar import OutputConstraint, schema_error
from agentcache.errors import InputError

__all__ = ["read_tool_choice", "response_constraint"]


def read_tool_choice(choice: Any, names: Sequence[str]) -> str | None:
    """`choice` as the runtime reads it: None (the model decides), "none", "required" (any tool) or a
    tool's name. "auto" is None; "any" (LangChain's word) and "required" are "required"; True is
    the only tool; `{"type": "function", "function": {"name": ...}}` names one."""
    if choice is None or choice == "auto":
        return None
    if choice is True:
        if len(names) != 1:
            raise InputError(f"tool_choice=True forces the single tool, but {len(names)} tools are bound {list(names)}")
        return names[0]
    if isinstance(choice, Mapping):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, Mapping) else None
        if not isinstance(name, str):
            raise InputError(f"tool_choice {dict(choice)!r} is not of the shape "
                             "{'type': 'function', 'function': {'name': ...}}")
        choice = name
    if not isinstance(choice, str) or not choice:
        raise InputError(f"tool_choice must be None, 'auto', 'none', 'any', 'required', a tool's name, True or "
                         f"{{'type': 'function', 'function': {{'name': ...}}}}; got {choice!r}")
    if choice == "none":
        return "none"
    if choice in ("any", "required"):
        if not names:
            raise InputError(f"tool_choice={choice!r} forces a tool call, but no tools are bound")
        return "required"
    if choice not in names:
        raise InputError(f"tool_choice names {choice!r}, which is not among the tools {list(names)}")
    return choice


def response_constraint(response_format: Any) -> OutputConstraint | None:
    """OpenAI's `response_format`: {"type": "json_object"} (any JSON object), {"type": "json_schema",
    "json_schema": {"schema": {...}}} (a value valid under the schema), or {"type": "text"}."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, Mapping) else None
        if not isinstance(schema, (Mapping, str)):
            raise InputError("response_format {'type': 'json_schema'} needs {'json_schema': {'schema': {...}}}")
        text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
        error = schema_error(text)
        if error is not None:
            raise InputError(f"response_format: the output constraint (json_schema) cannot be compiled: {error}")
        return OutputConstraint.json_schema(dict(schema) if isinstance(schema, Mapping) else schema)
    raise InputError(f"response_format must be {{'type': 'json_object'}}, {{'type': 'json_schema', 'json_schema': "
                     f"{{'schema': ...}}}} or {{'type': 'text'}}; got {response_format!r}")
