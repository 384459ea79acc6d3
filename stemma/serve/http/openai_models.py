"""Request bodies of the OpenAI-compatible routes, as pydantic models (FastAPI checks them and
publishes their schema). Unknown fields are ignored, as vLLM and SGLang do. The sampling fields
shared by completions and chat live in `SamplingFields`; `sampling.params_of` turns them into the
one SamplingParams."""
from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, model_validator

NonNegInt = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[NonNegInt], Field(min_length=1)]
MAX_LOGPROBS = 20


def _takes_none(annotation: Any) -> bool:
    return annotation is None or (get_origin(annotation) in (Union, types.UnionType)
                                  and type(None) in get_args(annotation))


class OpenAIBody(BaseModel):
    """A request body part as OpenAI's clients send it: `null` for a field that is not nullable
    here means its default, as OpenAI's API and vLLM take it (clients that send every field, unset
    ones as null, are served). A required field given as null is still missing."""
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = {f.alias or name: f for name, f in cls.model_fields.items()}
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or _takes_none(fields[key].annotation)}


class StreamOptions(OpenAIBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, each chunk's choice's usage so far


class JsonSchemaFormat(OpenAIBody):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(OpenAIBody):
    """Fields both routes take: OpenAI's, then the vLLM / SGLang extras."""
    model: str
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = Field(default=None, ge=-2**63, lt=2**64)  # any 64-bit seed, as OpenAI's
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # extras (vLLM / SGLang)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int | None = Field(default=None, ge=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[NonNegInt] | None = None
    regex: str | None = None
    ebnf: str | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | str | None = None
    # vLLM's names for the same constraints (one constraint per request)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # scheduling (vLLM's and SGLang's `priority`; stemma's latency targets)
    priority: int | None = Field(default=None, ge=-2**31, lt=2**31)
    ttft_slo_ms: float | None = Field(default=None, gt=0)
    itl_slo_ms: float | None = Field(default=None, gt=0)
    # the program context (stemma.program_call): {program_id, call_index, fork_parent, continues,
    # pause_s}, checked by ProgramCall
    program_call: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], TokenIds, list[TokenIds]]
    max_tokens: int | None = Field(default=16, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1, le=128)


class TextPart(OpenAIBody):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None   # an assistant turn's calls (OpenAI's shape)
    tool_call_id: str | None = None                  # a tool turn's answer to one of them


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # tool definitions reach the chat template; what tool_choice forces: stemma.serve.http.tools
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None


class GenerateRequest(BaseModel):
    """stemma's native route (`stemma.connect("http://...")`): one prompt, all of SamplingParams."""
    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: TokenIds | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = Field(default=None, min_length=1, max_length=256)
    salt: str | None = Field(default=None, max_length=256)
    program: str | None = Field(default=None, max_length=256)
    program_call: dict[str, Any] | None = None


class EndProgramRequest(BaseModel):
    """`/end_program`: the program calls no more (stemma.program_call)."""
    model_config = ConfigDict(extra="forbid")
    program_id: str = Field(min_length=1, max_length=256)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None   # with messages: rendered as chat renders them


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[NonNegInt]
