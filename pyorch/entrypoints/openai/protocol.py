"""Request and response bodies of the OpenAI-compatible server (pydantic v2).

Field names, defaults and shapes follow OpenAI's API; the extra sampling knobs (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, ...) and the chat extras (`add_generation_prompt`,
`continue_final_message`) are vLLM's. Bounds that the schema can state are stated here, so bad
values are answered with 400 before any work is done; the rest is checked by `SamplingParams`.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

# OpenAI caps n at 128. logprobs / top_logprobs are capped by the server's --max-logprobs
# (vLLM's max_logprobs, default 20), checked when the request is turned into SamplingParams.
MAX_N = 128
# Bounds on list fields that neither OpenAI nor vLLM state (ours; docs/serving.md lists them).
# Each keeps a request's cost proportionate: stop strings are matched on every output step,
# bad words and prompts are tokenized, each prompt x n is a sequence in the engine.
MAX_STOP = 64               # stop strings (OpenAI allows 4)
MAX_STOP_CHARS = 1024       # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 1024
MAX_LOGIT_BIAS = 1024       # entries (vLLM: no bound; OpenAI documents none either)
MAX_PROMPTS = 256           # prompts in one /v1/completions request
MAX_SEQUENCES = 1024        # prompts x n in one request
MAX_MESSAGES = 4096         # chat messages
MAX_TOOLS = 512             # tools offered in one request
MAX_TOOL_NAME = 256         # characters of a function name
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # entries of allowed_token_ids (more than any vocabulary here)
# torch generators take 64-bit seeds; the engine adds the sample index to the seed for n > 1.
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBaseModel(BaseModel):
    # Unknown fields are accepted and ignored (OpenAI clients send newer fields than we know);
    # NaN and infinities are refused: they are never meaningful sampling values.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = True
    # vLLM: usage (so far) in every chunk, not only in the last one
    continuous_usage_stats: Optional[bool] = False


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: Optional[int] = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details: prompt tokens served from the prefix cache.
    prompt_tokens_details: Optional[PromptTokenUsageInfo] = None


class JsonSchemaResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format.json_schema`: the schema travels under the key `schema`."""

    name: str
    description: Optional[str] = None
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None


class StructuresResponseFormat(OpenAIBaseModel):
    """One structure of vLLM's legacy structural tag: `begin`, JSON matching `schema`, `end`."""

    begin: str
    json_schema: Optional[dict[str, Any]] = Field(None, alias="schema")
    end: str


class ResponseFormat(OpenAIBaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or JSON matching a schema; and
    vLLM's `structural_tag` (xgrammar's: `format`, or the legacy `structures` + `triggers`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaResponseFormat] = None
    format: Optional[dict[str, Any]] = None  # structural_tag: xgrammar's format object
    structures: Optional[list[StructuresResponseFormat]] = None  # structural_tag (legacy)
    triggers: Optional[list[str]] = None  # structural_tag (legacy)


class SamplingExtras(OpenAIBaseModel):
    """The sampling knobs both endpoints share (OpenAI's, then vLLM's extras)."""

    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, float]] = Field(None, max_length=MAX_LOGIT_BIAS)
    seed: Optional[int] = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: Optional[Union[Annotated[str, Field(max_length=MAX_STOP_CHARS)],
                         Annotated[list[Annotated[str, Field(max_length=MAX_STOP_CHARS)]],
                                   Field(max_length=MAX_STOP)]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # vLLM's extra parameters
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: Optional[list[int]] = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    bad_words: Optional[list[Annotated[str, Field(max_length=MAX_BAD_WORD_CHARS)]]] = Field(
        None, max_length=MAX_BAD_WORDS)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: Optional[list[int]] = Field(None, max_length=MAX_ALLOWED_TOKEN_IDS)
    # vLLM's request-level extras; their rules are in request_fields.py.
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    prompt_logprobs: Optional[int] = Field(None, ge=-1)
    priority: int = Field(0, ge=_SEED_MIN, le=_SEED_MAX)
    return_token_ids: Optional[bool] = None
    return_tokens_as_token_ids: Optional[bool] = None
    # Structured output, at most one of these (vLLM's `structured_outputs` and its older
    # `guided_*` names; OpenAI's `response_format`): see OpenAIServing.structured_outputs.
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


class CompletionRequest(SamplingExtras):
    """POST /v1/completions. `prompt`: a string, a list of strings, token ids, or a list of
    token-id lists."""

    model: Optional[str] = None
    prompt: Union[str, Annotated[list[str], Field(max_length=MAX_PROMPTS)], list[int],
                  Annotated[list[list[int]], Field(max_length=MAX_PROMPTS)]]
    max_tokens: Optional[int] = Field(16, ge=1)
    echo: Optional[bool] = False
    logprobs: Optional[int] = Field(None, ge=0)
    suffix: Optional[str] = None
    add_special_tokens: bool = True


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ChatToolCall(OpenAIBaseModel):
    """A tool call an assistant message made (sent back in the next turn)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or OpenAI's list of content parts (only {"type": "text"} parts are supported).
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ChatToolCall]] = None  # assistant messages
    tool_call_id: Optional[str] = None  # tool messages: the call this answers
    reasoning: Optional[str] = None  # vLLM: an earlier turn's reasoning, for the template
    reasoning_content: Optional[str] = None  # its deprecated name


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=MAX_TOOL_NAME)
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON schema of the arguments object
    strict: Optional[bool] = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    """tool_choice={"type": "function", "function": {"name": ...}}: call exactly this tool."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class ChatCompletionRequest(SamplingExtras):
    """POST /v1/chat/completions."""

    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Optional[int] = Field(None, ge=1)  # deprecated by OpenAI, still accepted
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = Field(None, ge=0)
    # vLLM's extra parameters
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    echo: bool = False
    # Tool calling (OpenAI's fields; docs/serving.md#tool-calling)
    tools: Optional[list[ChatTool]] = Field(None, max_length=MAX_TOOLS)
    tool_choice: Optional[ToolChoice] = None
    parallel_tool_calls: Optional[bool] = True


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


# vLLM's prompt_logprobs: per prompt position (the first is None), token id -> its Logprob
# ({"logprob", "rank", "decoded_token"}), the prompt's own token plus the top ones.
PromptLogprobsJSON = list[Optional[dict[int, dict[str, Any]]]]


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobsJSON] = None
    # With return_token_ids (vLLM):
    prompt_token_ids: Optional[list[int]] = None
    token_ids: Optional[list[int]] = None


class CompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Optional[UsageInfo] = None
    system_fingerprint: Optional[str] = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    # --reasoning-parser: vLLM's `reasoning`, and `reasoning_content`, its deprecated copy
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids (vLLM)


class ChatCompletionResponse(OpenAIBaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: Optional[str] = None
    prompt_logprobs: Optional[PromptLogprobsJSON] = None
    prompt_token_ids: Optional[list[int]] = None  # with return_token_ids (vLLM)


class DeltaMessage(OpenAIBaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Optional[UsageInfo] = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pyorch"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: Optional[str] = None
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False
    tools: Optional[list[ChatTool]] = Field(None, max_length=MAX_TOOLS)  # for the template


TokenizeRequest = Union[TokenizeCompletionRequest, TokenizeChatRequest]


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


class VersionResponse(OpenAIBaseModel):
    version: str
