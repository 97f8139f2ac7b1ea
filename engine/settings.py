"""What a generation is asked to do: sampling settings and which internals to observe."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.device_map import PlacementError, parse_device_map, parse_max_memory


class SettingsError(ValueError):
    """A sampling or probe setting is out of range; the message says which and why."""


@dataclass(frozen=True, slots=True)
class GenerationSettings:
    """Sampling settings. `greedy=True` ignores temperature, top-k and top-p."""

    max_new_tokens: int = 256
    greedy: bool = False
    temperature: float = 0.7
    top_k: int = 50  # 0 disables
    top_p: float = 0.9
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    # Teaching mode: re-run the whole sequence every step instead of reading the KV cache.
    use_cache: bool = True
    # Benchmarks: always generate max_new_tokens (as generate's min_new_tokens does).
    ignore_eos: bool = False
    # When the conversation outgrows the context: "drop_oldest" turns (the system prompt
    # stays) or "stop" with a notice.
    context_policy: str = "drop_oldest"
    # Completion mode: the messages' text is fed as written, without the chat template, and
    # the model continues it (system prompts are left out: they belong to the template).
    completion: bool = False
    # Stepping (a teacher's pace): hold the reply once the prompt is prefilled, until the
    # session's pacer lets the next step through (engine/generate/pacing.py).
    pause_after_prefill: bool = False
    # Token.text per token (every whole character so far) rather than by whole words: an API
    # client then gets a reply's first word with its first token (engine/text/detokenize.py).
    text_per_token: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise SettingsError(f"max new tokens must be at least 1, got {self.max_new_tokens}")
        if not self.greedy and self.temperature <= 0:
            raise SettingsError(
                f"temperature must be above 0 (got {self.temperature}); use greedy decoding instead"
            )
        if self.top_k < 0:
            raise SettingsError(f"top-k must be 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise SettingsError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.context_policy not in ("drop_oldest", "stop"):
            raise SettingsError(
                f"context policy must be 'drop_oldest' or 'stop', got {self.context_policy!r}"
            )
        if self.repetition_penalty <= 0:
            raise SettingsError(
                f"repetition penalty must be above 0, got {self.repetition_penalty}"
            )


FEWEST_ROWS = 16  # a cell budget never keeps fewer rows of attention than this


def rows_within(max_rows: int, max_cells: int | None, keys: int) -> int:
    """How many rows of attention over `keys` keys to keep: `max_rows`, fewer once rows x keys
    would pass `max_cells` (per head), and never fewer than FEWEST_ROWS (or `max_rows`).

    A row per token over the whole context grows memory as keys x rows: 256 rows at 10,000
    keys are 370 MB for four watched layers of nine heads, in the window and across the pipe
    from the engine. The engine's prompt rows and the window's kept rows share this bound.
    """
    if max_cells is None or keys <= 0:
        return max_rows
    return min(max_rows, max(max_cells // keys, FEWEST_ROWS))


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """Which internals a generation records into its events.

    `attention_layers`: the layers whose attention weights are captured (empty: none).
    `top_k`: how many next-token candidates each Token event carries (0: none).
    `prefill_rows`: at most this many query rows of the prompt's attention matrix are kept
    (the last ones), so a long prompt does not allocate heads x n x n floats per layer.
    `prefill_cells`: and at most this many weights per head (rows x keys; None: no bound), so
    a long context keeps fewer rows (see `rows_within`).
    `token_rows`: whether each Token event carries its attention rows (the trace, the terminal
    chat). The window sets it False: a Token then carries each watched layer's per-head
    statistics only, and the rows stay in the session's ring of recent steps
    (engine/model/step_ring.py) until a panel pulls them.
    `ring_bytes`: the most that ring holds; the oldest steps leave it first.
    `prompt_layers`: the layers whose prompt matrix the PrefillDone carries to the host (None:
    every watched layer); the others' stay on the model's device, their statistics crossing.
    """

    attention_layers: tuple[int, ...] = ()
    top_k: int = 10
    prefill_rows: int = 512
    kv_per_layer: bool = True
    prefill_cells: int | None = None
    token_rows: bool = True
    ring_bytes: int = 64 * 2**20
    prompt_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.top_k < 0:
            raise SettingsError(f"probe top-k must be 0 or positive, got {self.top_k}")
        if self.prefill_rows < 1:
            raise SettingsError(f"prefill rows must be at least 1, got {self.prefill_rows}")
        if self.prefill_cells is not None and self.prefill_cells < 1:
            raise SettingsError(f"prefill cells must be at least 1, got {self.prefill_cells}")
        if self.ring_bytes < 0:
            raise SettingsError(
                f"the ring of steps must hold 0 bytes or more, not {self.ring_bytes}"
            )

    def prompt_rows(self, queries: int, keys: int) -> int:
        """How many of a prompt's last `queries` rows to keep, each over `keys` keys."""
        return min(queries, rows_within(self.prefill_rows, self.prefill_cells, keys))

    @classmethod
    def off(cls) -> ProbeSettings:
        """Observe nothing: the plain chat path the benchmark compares against."""
        return cls(attention_layers=(), top_k=0, kv_per_layer=False)

    @classmethod
    def for_chat(cls, layers: tuple[int, ...] = (), candidates: bool = False) -> ProbeSettings:
        """What the terminal chat records: `layers`' attention and the next-token candidates
        only when asked for (--trace, --json); a plain chat records neither."""
        return cls(attention_layers=layers, top_k=10 if candidates else 0)


def parse_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """Parse a layer list such as "all", "0,14,29" or "-1" (negative counts from the end)."""
    spec = spec.strip().lower()
    if spec in ("", "none"):
        return ()
    if spec == "all":
        return tuple(range(num_layers))
    layers: list[int] = []
    for part in spec.split(","):
        try:
            index = int(part)
        except ValueError:
            raise SettingsError(f"not a layer number: {part!r}") from None
        if index < 0:
            index += num_layers
        if not 0 <= index < num_layers:
            raise SettingsError(f"layer {part.strip()} is outside 0..{num_layers - 1}")
        if index not in layers:
            layers.append(index)
    return tuple(layers)


@dataclass(frozen=True, slots=True)
class Message:
    """One chat message as the chat template takes it."""

    role: str  # "system", "user" or "assistant"
    content: str

    def as_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


PRECISIONS = ("auto", "exact", "fast")
# The chat template a load uses (engine/text/chat_format.py): "auto" is the model's own, else for a
# GGUF without one its architecture's; "plain" the user:/assistant: transcript; or one by name.
CHAT_TEMPLATES = ("auto", "plain", "gemma", "chatml", "llama3")


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """Which model to load and where. `spec` is "bundled", a hub id, a folder or a .gguf path.

    `precision`: "exact" runs dequantised weights in transformers (the reference), "fast" runs
    a GGUF's own 4/8-bit weights in Glassbox's model, "auto" picks fast where it can.
    `compiled`: give a fast model a compiled decode step, built once in the background
    (engine/step/compiled.py; $GLASSBOX_COMPILE=0 turns it off everywhere);
    `build_compiled=False` uses one only if it is already kept (a one-shot reply, which would
    exit long before a build ends).
    `chat_template`: "auto", or a template to use whatever the model has (CHAT_TEMPLATES).
    `device_map`, `max_memory`: where the layers go (engine/device_map.py): "" and "" keep
    the whole model on `device`, with no placement machinery at all.
    """

    spec: str = "bundled"
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", "mps"
    dtype: str = "auto"  # "auto", "float32", "bfloat16", "float16"
    extra: dict[str, str] = field(default_factory=dict)
    precision: str = "auto"
    compiled: bool = True
    build_compiled: bool = True
    chat_template: str = "auto"  # one of CHAT_TEMPLATES
    device_map: str = ""  # "", "auto", "balanced", "sequential" or "gpu-layers=N"
    max_memory: str = ""  # e.g. "cpu=250MiB,cuda:0=6GiB"

    @property
    def placed(self) -> bool:
        """Whether this load asks for a placement (a device map or a memory cap)."""
        return bool(self.device_map.strip() or self.max_memory.strip())

    def __post_init__(self) -> None:
        try:
            parse_device_map(self.device_map)
            parse_max_memory(self.max_memory)
        except PlacementError as error:
            raise SettingsError(str(error)) from None
        if self.precision not in PRECISIONS:
            raise SettingsError(
                f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}"
            )
        if self.chat_template not in CHAT_TEMPLATES:
            raise SettingsError(
                f"chat template must be one of {', '.join(CHAT_TEMPLATES)},"
                f" got {self.chat_template!r}"
            )
