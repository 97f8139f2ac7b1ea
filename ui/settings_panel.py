"""System prompt and sampling settings, read as a GenerationSettings when a reply starts."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.settings import GenerationSettings
from ui.serve_settings import ServeSettings

SEED_MAX = 2**31 - 1


def _double(low: float, high: float, step: float, decimals: int, tip: str) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(low, high)
    box.setSingleStep(step)
    box.setDecimals(decimals)
    box.setToolTip(tip)
    return box


def _int(low: int, high: int, tip: str) -> QSpinBox:
    box = QSpinBox()
    box.setRange(low, high)
    box.setToolTip(tip)
    return box


class SettingsPanel(QWidget):
    """Editable system prompt and sampling controls; `changed` fires on any edit.

    The completion switch belongs to the open conversation: `completion_toggled` fires when
    the user flips it, so the conversation can keep its mode; `set_completion` shows one.
    """

    changed = Signal()
    completion_toggled = Signal(bool)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._prompt = QPlainTextEdit()
        self._prompt.setPlaceholderText("System prompt (optional): sent first in every request")
        self._prompt.setMaximumHeight(110)
        self._completion = QCheckBox("Completion mode: continue my text as written")
        self._completion.setToolTip(
            "No chat template: the model sees exactly the text you type and continues it, as a"
            ' base model would (try "Today\'s weather is so"). Kept with this conversation.'
        )

        self._greedy = QCheckBox("Greedy (always the most likely token)")
        self._temperature = _double(
            0.01, 5.0, 0.05, 2, "Above 1 flattens the distribution, below 1 sharpens it."
        )
        self._top_k = _int(0, 100_000, "Sample among the k most likely tokens; 0 turns it off.")
        self._top_k.setSpecialValueText("off")
        self._top_p = _double(
            0.01, 1.0, 0.05, 2, "Sample among the most likely tokens whose total is p."
        )
        self._repetition = _double(
            0.5, 3.0, 0.05, 2, "Above 1 makes tokens already in the context less likely."
        )
        self._seed_fixed = QCheckBox("Fixed seed")
        self._seed = _int(0, SEED_MAX, "The same seed and settings give the same reply.")
        self._max_tokens = _int(1, 32_768, "The reply stops after this many tokens.")
        self._no_cache = QCheckBox("Recompute everything each step (no KV cache)")
        self._no_cache.setToolTip(
            "Teaching mode: re-run the whole sequence for every token to feel what the KV"
            " cache saves. Much slower."
        )
        self._pause_after_prefill = QCheckBox("Pause after prefill (then step with Next token)")
        self._pause_after_prefill.setToolTip(
            "Teaching: hold each reply once its prompt is processed, then go one token at a"
            " time (Next token), slowly (Play slowly) or on (Resume)."
        )
        self._context_policy = QComboBox()
        self._context_policy.addItem("Drop the oldest turns", "drop_oldest")
        self._context_policy.addItem("Stop and tell me", "stop")
        self._context_policy.setToolTip(
            "When the conversation no longer fits the model's context window: leave out the"
            " oldest turns (the system prompt stays), or refuse the message with a notice."
        )
        self._stop_strings: tuple[str, ...] = ()
        self.serve = ServeSettings()  # the API server's address and key (app.window.serving)
        self._layout()
        self.set_settings(GenerationSettings())
        self._connect()

    def _layout(self) -> None:
        seed_row = QHBoxLayout()
        seed_row.addWidget(self._seed_fixed)
        seed_row.addWidget(self._seed, 1)
        form = QFormLayout()
        form.addRow(self._greedy)
        form.addRow("Temperature", self._temperature)
        form.addRow("Top-k", self._top_k)
        form.addRow("Top-p", self._top_p)
        form.addRow("Repetition penalty", self._repetition)
        form.addRow("Seed", seed_row)
        form.addRow("Max new tokens", self._max_tokens)
        form.addRow(self._no_cache)
        form.addRow(self._pause_after_prefill)
        form.addRow("When the context is full", self._context_policy)
        layout = QVBoxLayout(self)
        layout.addWidget(self._completion)
        layout.addWidget(QLabel("System prompt"))
        layout.addWidget(self._prompt)
        layout.addLayout(form)
        layout.addWidget(self.serve)
        layout.addStretch(1)

    def _connect(self) -> None:
        self._prompt.textChanged.connect(self.changed)
        self._context_policy.currentIndexChanged.connect(self.changed)
        self._completion.toggled.connect(self._sync_enabled)
        self._completion.toggled.connect(self.changed)
        self._completion.clicked.connect(self.completion_toggled)  # the user's flips only
        for box in (self._greedy, self._seed_fixed, self._no_cache, self._pause_after_prefill):
            box.toggled.connect(self._sync_enabled)
            box.toggled.connect(self.changed)
        for spin in (
            self._temperature,
            self._top_k,
            self._top_p,
            self._repetition,
            self._seed,
            self._max_tokens,
        ):
            spin.valueChanged.connect(self.changed)

    def _sync_enabled(self) -> None:
        self._prompt.setEnabled(not self._completion.isChecked())  # no template, no system turn
        sampling = not self._greedy.isChecked()
        for widget in (self._temperature, self._top_k, self._top_p, self._seed_fixed):
            widget.setEnabled(sampling)
        self._seed.setEnabled(sampling and self._seed_fixed.isChecked())

    # -- public API ----------------------------------------------------------------------------

    def settings(self) -> GenerationSettings:
        """The settings as shown; the ranges of the controls keep them valid."""
        return GenerationSettings(
            max_new_tokens=self._max_tokens.value(),
            greedy=self._greedy.isChecked(),
            temperature=self._temperature.value(),
            top_k=self._top_k.value(),
            top_p=self._top_p.value(),
            repetition_penalty=self._repetition.value(),
            seed=self._seed.value() if self._seed_fixed.isChecked() else None,
            stop_strings=self._stop_strings,
            use_cache=not self._no_cache.isChecked(),
            context_policy=self._context_policy.currentData(),
            completion=self._completion.isChecked(),
            pause_after_prefill=self._pause_after_prefill.isChecked(),
        )

    def set_settings(self, settings: GenerationSettings) -> None:
        self._greedy.setChecked(settings.greedy)
        self._temperature.setValue(settings.temperature)
        self._top_k.setValue(settings.top_k)
        self._top_p.setValue(settings.top_p)
        self._repetition.setValue(settings.repetition_penalty)
        self._seed_fixed.setChecked(settings.seed is not None)
        if settings.seed is not None:
            self._seed.setValue(settings.seed)
        self._max_tokens.setValue(settings.max_new_tokens)
        self._no_cache.setChecked(not settings.use_cache)
        self._pause_after_prefill.setChecked(settings.pause_after_prefill)
        self._context_policy.setCurrentIndex(self._context_policy.findData(settings.context_policy))
        self._stop_strings = settings.stop_strings
        self._completion.setChecked(settings.completion)
        self._sync_enabled()

    def set_pause_after_prefill(self, on: bool) -> None:
        self._pause_after_prefill.setChecked(on)

    def pause_after_prefill(self) -> bool:
        return self._pause_after_prefill.isChecked()

    def completion(self) -> bool:
        return self._completion.isChecked()

    def set_completion(self, on: bool) -> None:
        """Show a conversation's mode (not a user's flip: `completion_toggled` stays quiet)."""
        self._completion.setChecked(on)

    def system_prompt(self) -> str:
        return self._prompt.toPlainText().strip()

    def set_system_prompt(self, text: str) -> None:
        self._prompt.setPlainText(text)
