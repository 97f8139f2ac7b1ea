"""Choose a model (bundled, hub id, folder, .gguf file), a device, a precision and a dtype;
watch it load."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QButtonGroup,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFormLayout,
    QGridLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QProgressBar,
    QPushButton,
    QRadioButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.device_map import PlacementError, parse_device_map, parse_max_memory
from engine.events import ModelInfo
from engine.settings import PRECISIONS, LoadRequest, SettingsError

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "float32", "bfloat16", "float16")
SOURCES = ("bundled", "hub", "folder", "gguf")
# (label, --device-map) of the placement choices; "gpu-layers" takes the spin box's count
PLACEMENTS = (
    ("Whole model on the device", ""),
    ("Automatic: what is free, disk for the rest", "auto"),
    ("Layers on the GPU", "gpu-layers"),
)
ERROR_STYLE = "color: #c62828;"


def placement_words(request: LoadRequest) -> str:
    """A request's placement as a button says it, e.g. "automatic placement, 2.0 GiB RAM cap"."""
    choice = parse_device_map(request.device_map)
    where = (
        f"{choice.gpu_layers} layers on the GPU"
        if choice.strategy == "gpu-layers"
        else f"{'automatic' if choice.strategy in ('', 'auto') else choice.strategy} placement"
    )
    cap = parse_max_memory(request.max_memory).get("cpu")
    return where + (f", a RAM cap of {cap >> 20} MiB (the rest on disk)" if cap is not None else "")


def choices(items: Sequence[str], tip: str = "") -> QComboBox:
    box = QComboBox()
    box.addItems(list(items))
    box.setToolTip(tip)
    return box


class ModelPicker(QDialog):
    """Emits `load_requested(LoadRequest)` and stays open, showing progress, until the window
    reports the result through `set_progress`, `set_failed` or `set_loaded` (which closes it)."""

    load_requested = Signal(object)

    def __init__(self, current: LoadRequest | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Load a model")
        self.setMinimumWidth(520)
        self._radios: dict[str, QRadioButton] = {}
        self._group = QButtonGroup(self)
        self._hub = QLineEdit()
        self._hub.setPlaceholderText("e.g. HuggingFaceTB/SmolLM2-360M-Instruct")
        self._folder = QLineEdit()
        self._folder.setPlaceholderText("a folder with config.json and weights")
        self._gguf = QLineEdit()
        self._gguf.setPlaceholderText("a .gguf file")
        self._device = choices(DEVICES)
        self._device.setEditable(True)  # "cuda:1" and the like
        self._dtype = choices(DTYPES)
        self._precision = choices(
            PRECISIONS,
            "exact: dequantised weights in transformers (the reference).\n"
            "fast: a GGUF's own 4/8-bit weights in Glassbox's model (on the CPU; on CUDA\n"
            "its static decode step).\n"
            "auto: fast for a GGUF it can run (CPU or CUDA), exact otherwise.",
        )
        self._placement = choices(
            [label for label, _ in PLACEMENTS],
            "Where the layers go. What does not fit in RAM is read from disk before each\n"
            "use: on the exact path on every token; at fast precision (a GGUF on the CPU)\n"
            "from the mapped file, only where the OS has dropped its pages. Slower, but a\n"
            "model bigger than memory runs.",
        )
        self._gpu_layers = QSpinBox()
        self._gpu_layers.setRange(0, 999)
        self._gpu_layers.setPrefix("N = ")
        self._ram_cap = QLineEdit()
        self._ram_cap.setPlaceholderText("no cap (e.g. 250MiB)")
        self._ram_cap.setToolTip("The most RAM the weights may take; the rest goes to disk.")
        self._placement.currentIndexChanged.connect(self._sync_placement)
        self._progress = QProgressBar()
        self._progress.setRange(0, 100)
        self._progress.setVisible(False)
        self._status = QLabel()
        self._status.setWordWrap(True)
        self._status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self._fits_as: LoadRequest | None = None  # a failed load's placement that would fit
        self.fit_button = QPushButton()
        self.fit_button.setVisible(False)
        self.fit_button.clicked.connect(self._load_fitting)
        self._buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        self.load_button = self._buttons.addButton("Load", QDialogButtonBox.ButtonRole.AcceptRole)
        self._build()
        self.set_request(current or LoadRequest())

    def _build(self) -> None:
        grid = QGridLayout()
        labels = {
            "bundled": "Bundled SmolLM2-135M-Instruct",
            "hub": "Hugging Face hub id",
            "folder": "Local folder",
            "gguf": "GGUF file",
        }
        editors = self._editors
        for row, source in enumerate(SOURCES):
            radio = QRadioButton(labels[source])
            self._radios[source] = radio
            self._group.addButton(radio, row)
            grid.addWidget(radio, row, 0)
            if source in editors:
                grid.addWidget(editors[source], row, 1)
                editors[source].textEdited.connect(lambda _, r=radio: r.setChecked(True))
        browse_folder = QPushButton("Browse…")
        browse_folder.clicked.connect(self._browse_folder)
        browse_gguf = QPushButton("Browse…")
        browse_gguf.clicked.connect(self._browse_gguf)
        grid.addWidget(browse_folder, 2, 2)
        grid.addWidget(browse_gguf, 3, 2)
        source_box = QGroupBox("Model")
        source_box.setLayout(grid)

        where = QHBoxLayout()
        form_device = QFormLayout()
        form_device.addRow("Device", self._device)
        form_precision = QFormLayout()
        form_precision.addRow("Precision", self._precision)
        form_dtype = QFormLayout()
        form_dtype.addRow("Dtype", self._dtype)
        where.addLayout(form_device)
        where.addLayout(form_precision)
        where.addLayout(form_dtype)

        placement = QHBoxLayout()
        form_placement = QFormLayout()
        form_placement.addRow("Placement", self._placement)
        placement.addLayout(form_placement)
        placement.addWidget(self._gpu_layers)
        form_cap = QFormLayout()
        form_cap.addRow("RAM cap", self._ram_cap)
        placement.addLayout(form_cap)

        layout = QVBoxLayout(self)
        layout.addWidget(source_box)
        layout.addLayout(where)
        layout.addLayout(placement)
        layout.addWidget(self._progress)
        layout.addWidget(self._status)
        layout.addWidget(self.fit_button, 0, Qt.AlignmentFlag.AlignLeft)
        layout.addWidget(self._buttons)
        self.load_button.clicked.connect(self._on_load)
        self._buttons.rejected.connect(self.reject)

    # -- the request -----------------------------------------------------------------------------

    def source(self) -> str:
        return next(s for s, radio in self._radios.items() if radio.isChecked())

    def set_source(self, source: str) -> None:
        self._radios[source].setChecked(True)

    @property
    def _editors(self) -> dict[str, QLineEdit]:
        """Each source's location, where it has one."""
        return {"hub": self._hub, "folder": self._folder, "gguf": self._gguf}

    def set_location(self, source: str, text: str) -> None:
        self._editors[source].setText(text)
        self.set_source(source)

    def set_device(self, device: str) -> None:
        self._device.setCurrentText(device)

    def set_dtype(self, dtype: str) -> None:
        self._dtype.setCurrentText(dtype)

    def set_precision(self, precision: str) -> None:
        self._precision.setCurrentText(precision)

    def request(self) -> LoadRequest:
        source = self.source()
        spec = {
            "bundled": "bundled",
            "hub": self._hub.text().strip(),
            "folder": self._folder.text().strip(),
            "gguf": self._gguf.text().strip(),
        }[source]
        device = self._device.currentText().strip() or "auto"
        return LoadRequest(
            spec=spec,
            device=device,
            dtype=self._dtype.currentText(),
            precision=self._precision.currentText(),
            device_map=self.device_map(),
            max_memory=self.max_memory(),
        )

    def device_map(self) -> str:
        choice = PLACEMENTS[self._placement.currentIndex()][1]
        return f"gpu-layers={self._gpu_layers.value()}" if choice == "gpu-layers" else choice

    def max_memory(self) -> str:
        cap = self._ram_cap.text().strip()
        return f"cpu={cap}" if cap else ""

    def set_placement(self, device_map: str, max_memory: str = "") -> None:
        """Show a request's placement (one the picker cannot show keeps its RAM cap only)."""
        try:
            choice = parse_device_map(device_map)
            cap = parse_max_memory(max_memory).get("cpu")
        except PlacementError:
            choice, cap = parse_device_map(""), None
        index = [value for _, value in PLACEMENTS].index(
            choice.strategy if choice.strategy in ("", "gpu-layers") else "auto"
        )
        self._placement.setCurrentIndex(index)
        self._gpu_layers.setValue(choice.gpu_layers)
        self._ram_cap.setText(f"{cap >> 20}MiB" if cap is not None else "")
        self._sync_placement()

    def _sync_placement(self) -> None:
        self._gpu_layers.setVisible(PLACEMENTS[self._placement.currentIndex()][1] == "gpu-layers")

    def set_request(self, request: LoadRequest) -> None:
        spec = request.spec.strip()
        if spec in ("", "bundled"):
            self.set_source("bundled")
        elif spec.lower().endswith(".gguf"):
            self.set_location("gguf", spec)
        elif Path(spec).expanduser().is_dir():
            self.set_location("folder", spec)
        else:
            self.set_location("hub", spec)
        self.set_device(request.device)
        self.set_dtype(request.dtype)
        self.set_precision(request.precision)
        self.set_placement(request.device_map, request.max_memory)

    def problem(self) -> str | None:
        """Why the current choice cannot be loaded, or None."""
        try:
            source, spec = self.source(), self.request().spec
        except SettingsError as error:
            return f"Placement: {error}."
        if source == "bundled":
            return None
        if not spec:
            return {
                "hub": "Type a hub id such as HuggingFaceTB/SmolLM2-360M-Instruct.",
                "folder": "Choose a folder.",
                "gguf": "Choose a .gguf file.",
            }[source]
        path = Path(spec).expanduser()
        if source == "folder" and not path.is_dir():
            return f"{spec} is not a folder."
        if source == "gguf" and (path.suffix.lower() != ".gguf" or not path.is_file()):
            return f"{spec} is not a .gguf file."
        return None

    # -- loading ---------------------------------------------------------------------------------

    def _on_load(self) -> None:
        problem = self.problem()
        if problem:
            self.set_failed(problem)
            return
        self.load_button.setEnabled(False)
        self.fit_button.setVisible(False)
        self._progress.setValue(0)
        self._progress.setVisible(True)
        self._status.setText("Loading…")
        self._status.setStyleSheet("")
        self.load_requested.emit(self.request())

    def set_progress(self, stage: str, fraction: float) -> None:
        self._progress.setVisible(True)
        self._progress.setValue(round(max(0.0, min(fraction, 1.0)) * 100))
        self._status.setText(stage)
        self._status.setStyleSheet("")

    def set_failed(self, message: str, fits_as: LoadRequest | None = None) -> None:
        """Show why a load failed; `fits_as`, the same model placed so that it fits, is
        offered as one button that loads it."""
        self.load_button.setEnabled(True)
        self._progress.setVisible(False)
        self._status.setText(message)
        self._status.setStyleSheet(ERROR_STYLE)
        self._fits_as = fits_as
        self.fit_button.setVisible(fits_as is not None)
        if fits_as is not None:
            self.fit_button.setText(f"Load with {placement_words(fits_as)}")
        # Back to the location to correct (the disabled Load button had passed the focus on
        # to the first field, the hub id, where a typed path changed the source)
        editor = self._editors.get(self.source())
        if editor is not None:
            editor.setFocus()
            editor.selectAll()

    def _load_fitting(self) -> None:
        if self._fits_as is not None:
            self.set_request(self._fits_as)
            self._on_load()

    def set_loaded(self, info: ModelInfo) -> None:
        self._status.setText(f"Loaded {info.name}.")
        self.load_button.setEnabled(True)
        self._progress.setVisible(False)
        self.accept()

    def status_text(self) -> str:
        return self._status.text()

    def is_loading(self) -> bool:
        return not self.load_button.isEnabled()

    def _browse_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Model folder", self._folder.text())
        if folder:
            self.set_location("folder", folder)

    def _browse_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "GGUF model", self._gguf.text(), "GGUF models (*.gguf);;All files (*)"
        )
        if path:
            self.set_location("gguf", path)
