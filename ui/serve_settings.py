"""Where the window serves the API: host, port and key, the Serve switch and what it says.

The widget only shows and edits; the app starts and stops the server (app.window.serving)."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Signal
from PySide6.QtGui import QAction
from PySide6.QtWidgets import (
    QFormLayout,
    QGroupBox,
    QLabel,
    QLineEdit,
    QSpinBox,
    QToolButton,
    QWidget,
)

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8080


@dataclass(frozen=True, slots=True)
class ServeOptions:
    host: str = LOOPBACK
    port: int = DEFAULT_PORT
    api_key: str = ""  # empty: no key asked (loopback only)


class ServeSettings(QGroupBox):
    """Host, port and API key of the window's server; `changed` fires on any edit."""

    changed = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__("Serve the OpenAI-compatible API", parent)
        self._host = QLineEdit()
        self._host.setToolTip(
            f"{LOOPBACK}: this machine only. Any other address lets other machines in and"
            " needs an API key."
        )
        self._port = QSpinBox()
        self._port.setRange(1, 65535)
        self._key = QLineEdit()
        self._key.setEchoMode(QLineEdit.EchoMode.Password)
        self._key.setPlaceholderText("none (this machine only)")
        self._key.setToolTip(
            "Clients send it as `Authorization: Bearer KEY`; 8 characters or more."
        )
        self.switch = QToolButton()  # shows the window's Serve action (set_action)
        self.status = QLabel("Not serving.")
        self.status.setWordWrap(True)
        form = QFormLayout(self)
        form.addRow("Host", self._host)
        form.addRow("Port", self._port)
        form.addRow("API key", self._key)
        form.addRow(self.switch, self.status)
        self.set_options(ServeOptions())
        for field in (self._host, self._key):
            field.textChanged.connect(self.changed)
        self._port.valueChanged.connect(self.changed)

    def set_action(self, action: QAction) -> None:
        self.switch.setDefaultAction(action)

    def options(self) -> ServeOptions:
        host = self._host.text().strip() or LOOPBACK
        return ServeOptions(host, self._port.value(), self._key.text().strip())

    def set_options(self, options: ServeOptions) -> None:
        self._host.setText(options.host)
        self._port.setValue(options.port)
        self._key.setText(options.api_key)

    def set_editable(self, editable: bool) -> None:
        """While serving, the address and key in use are shown, not edited."""
        for field in (self._host, self._port, self._key):
            field.setEnabled(editable)

    def set_status(self, text: str, error: bool = False) -> None:
        self.status.setText(text)
        self.status.setStyleSheet("color: #c0392b;" if error else "")
