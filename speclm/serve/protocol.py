"""What a client may send, checked, and the errors it gets back, in OpenAI's shapes.

Field names and defaults follow OpenAI's API (temperature 1, top_p 1; `max_tokens` 16 for
completions, the rest of the context for chat), `response_format` included (json_object and
json_schema: speclm.constraint). speclm's own fields: `speculation`: "off" (plain decoding), a
method name ("draft", "pld", "draft+pld", "none"), or an object {"method": ..., "k": N, "tree":
...}; a request that sets k keeps it every round (else the server's adaptive speculation may
lower it, speclm.round.adaptive); `regex` and `grammar` (Lark or GBNF), constraints as
response_format is; `top_k` and `ignore_eos` (as vLLM's).

A field the server does not honour is refused with a 400 that names it, unless it cannot change
the output (HARMLESS, listed in docs/serving.md); a field is never silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from speclm.constraint import Constraint
from speclm.errors import UsageError
from speclm.methods import NAMES as METHODS

# fields a client may send that cannot change what is generated: accepted and not acted on
HARMLESS = frozenset({"user", "metadata", "store", "service_tier", "prediction", "parallel_tool_calls",
                      "safety_identifier", "prompt_cache_key"})


class ApiError(Exception):
    """An error a client gets as OpenAI sends them: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class SpeculationSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: str | None = None
    k: int | None = Field(default=None, ge=1, le=64)
    tree: str | None = None

    @field_validator("method")
    @classmethod
    def _method(cls, v):
        if v is not None and v not in METHODS:
            raise ValueError(f"unknown method '{v}' (choose from {', '.join(METHODS)})")
        return v

    @field_validator("tree")
    @classmethod
    def _tree(cls, v):
        if v is not None and v not in ("chain", "auto"):
            raise ValueError("tree must be 'chain' or 'auto' (a tree file is the server's option only)")
        return v


def _refused(why: str):
    """A field validator for a field speclm does not implement: its default (unset, 0, false,
    empty) passes, any other value is refused with `why`."""

    def check(cls, v):
        if v:
            raise ValueError(why)
        return v

    return classmethod(check)


class _Common(BaseModel):
    """Fields chat and completions share. Any other field is refused (400) unless HARMLESS."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=16)  # choices: each sampled apart (seed + i), after the first's prefill
    stream: bool = False
    stream_options: dict | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    speculation: Any = None  # speclm's own field: see the module docstring
    ignore_eos: bool = False  # as vLLM's: generate max_tokens whatever the model says (load tests)
    top_k: int = Field(default=0, ge=0)  # as vLLM's: 0 (default) no top-k filter
    response_format: Any = None  # OpenAI's: {"type": "text" | "json_object" | "json_schema", ...}
    regex: str | None = None  # speclm's: the whole output matches it
    grammar: str | None = None  # speclm's: a Lark (llguidance) or GBNF grammar the output follows
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    logit_bias: Any = None

    _tools = field_validator("tools", "functions", "function_call")(_refused(
        "tools are not supported: the output is not parsed into tool_calls (constrain it with response_format)"))
    _logit_bias = field_validator("logit_bias")(_refused("logit_bias is not supported"))

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v not in (None, "none", "auto"):  # with no tools, "none" and "auto" change nothing
            raise ValueError("tools are not supported")
        return v

    @model_validator(mode="after")
    def _known(self):
        unknown = sorted(set(self.model_extra or ()) - HARMLESS)
        if unknown:
            raise ValueError(f"{unknown[0]}: not supported by this server (docs/serving.md lists the fields it takes)")
        return self

    def constraint(self) -> Constraint | None:
        """response_format, regex or grammar as the request's constraint (a 400 names a bad one)."""
        try:
            return Constraint.of(self.response_format, self.regex, self.grammar)
        except UsageError as exc:
            field = next((f for f in ("response_format", "regex", "grammar") if getattr(self, f) is not None), None)
            raise ApiError(400, str(exc), param=field) from None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        return stops

    _penalty = field_validator("presence_penalty", "frequency_penalty")(
        _refused("penalties change the target's distribution and are not supported"))

    @field_validator("speculation")
    @classmethod
    def _speculation(cls, v):
        if v is None or v is True:
            return None
        if v is False or v == "off":
            return SpeculationSpec(method="none")
        if isinstance(v, str) and v in METHODS:
            return SpeculationSpec(method=v)
        if isinstance(v, dict):
            try:
                return SpeculationSpec.model_validate(v)
            except ValidationError as exc:
                err = exc.errors()[0]
                field = ".".join(str(p) for p in err.get("loc", ()))
                raise ValueError(f"{field}: {err.get('msg', 'invalid').removeprefix('Value error, ')}") from None
        raise ValueError(f"must be 'off', a method ({', '.join(METHODS)}) or an object {{method, k, tree}}")

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def speculation_spec(self) -> SpeculationSpec | None:
        """None: the server's default; else the method (and k, tree) this request asked for."""
        return self.speculation


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a message's other fields (name, tool_calls, ...) are not passed on: 400
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    def logprobs_count(self) -> int | None:
        """The alternatives to return per token (GenerationOptions.logprobs), None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: Union[str, list[int], list[str]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=20)  # the legacy shape: the alternatives per token

    def logprobs_count(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("one prompt per request (a list of one string)")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("empty prompt")
        return v

    _echo = field_validator("echo")(_refused("echo is not supported"))
    _suffix = field_validator("suffix")(_refused("suffix is not supported"))


def parse(model: type[BaseModel], data: Any) -> Any:
    """The body as `model`, or a 400 ApiError naming the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ()) if not str(p).startswith("function-after"))
        message = err.get("msg", "invalid value").removeprefix("Value error, ")
        raise ApiError(400, f"{where}: {message}" if where else message, param=where or None) from None
