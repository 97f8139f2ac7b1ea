"""The request bodies `/v1/chat/completions` and `/v1/completions` accept, checked by pydantic
(strict types: `"5"` is not a number), and what they turn into: the engine's messages,
GenerationSettings and ProbeSettings.

Fields the API defines but Glassbox does not act on (`frequency_penalty`, `user`, `tools`...)
are ignored, as local servers do; `n` other than 1, `echo` and `suffix` are refused.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from engine.settings import GenerationSettings, Message, ProbeSettings

Number = StrictFloat | StrictInt
Text = Annotated[StrictStr, Field(min_length=1)]  # an empty prompt has nothing to continue
MAX_STOPS = 4  # OpenAI's own bound on stop sequences
MAX_TOP_LOGPROBS = 20  # chat's bound; completions' `logprobs` is at most 5
# The probe's candidates when log-probabilities are asked for: the sampled token's own
# log-probability comes from them, so as many as a client may ask to see.
PROBE_CANDIDATES = MAX_TOP_LOGPROBS


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class TextPart(Body):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(Body):
    # "developer" is newer clients' name for the system turn
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart] | None = None

    def message(self) -> Message:
        role = "system" if self.role == "developer" else self.role
        content = self.content
        text = "".join(p.text for p in content) if isinstance(content, list) else content or ""
        return Message(role, text)


class StreamOptions(Body):
    include_usage: StrictBool = False


class Sampling(Body):
    """What both endpoints share."""

    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOPS)] | None = None
    n: Literal[1] | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def settings(self, max_tokens: int, completion: bool) -> GenerationSettings:
        """The engine's settings: temperature 0 is greedy, OpenAI's defaults (1 and 1, no
        top-k) where a field is left out. Stops are kept as given (an empty one is dropped)."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        temperature = 1.0 if self.temperature is None else float(self.temperature)
        return GenerationSettings(
            max_new_tokens=max_tokens,
            greedy=temperature == 0,
            temperature=temperature if temperature > 0 else 1.0,
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=0,
            seed=self.seed,
            stop_strings=tuple(s for s in stops if s),
            completion=completion,
            context_policy="stop",  # a prompt too long is refused, never silently cut
            text_per_token=True,  # a chunk per token: the first word comes with the first token
        )


class ChatRequest(Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        """OpenAI refuses alternatives asked for without the log-probabilities they go with."""
        if top is not None and not info.data.get("logprobs"):
            raise ValueError("only allowed when logprobs is true")
        return top

    def asked_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def engine_messages(self) -> list[Message]:
        return [m.message() for m in self.messages]

    def probes(self) -> ProbeSettings:
        return _probes(self.logprobs)


class CompletionRequest(Sampling):
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=1)]
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    echo: Literal[False] = False
    suffix: None = None

    def asked_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def engine_messages(self) -> list[Message]:
        return [Message("user", self.prompt_text)]

    def probes(self) -> ProbeSettings:
        return _probes(self.logprobs is not None)


COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default for /v1/completions


def _probes(logprobs: bool) -> ProbeSettings:
    """Candidates only when log-probabilities are asked for; no attention, no per-layer KV."""
    return ProbeSettings(top_k=PROBE_CANDIDATES if logprobs else 0, kv_per_layer=False)
