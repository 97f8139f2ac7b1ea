"""The window's Serve switch: the OpenAI-compatible API (app.api) on the window's own engine.

    switch = ServeSwitch(window, worker, controller, qsettings)
    switch.action.setChecked(True)        # serve on the address the settings name

On: the address is checked as `glassbox serve` checks it (any host but loopback needs a key),
the socket is bound here (a port in use is said at once, in the window), and uvicorn runs the
API's app in a thread of this process, over the window's engine (app.window.api_bridge). Off,
or when the window quits: the requests under way end, uvicorn stops and its thread is joined.
Host, port and key are kept with the window's settings; serving itself always starts off.
"""

from __future__ import annotations

import logging
import os
import threading

import uvicorn
from PySide6.QtCore import QObject, QSettings
from PySide6.QtGui import QAction

from app.api.serve import bound_listener, cannot_listen, listen_refusal, uvicorn_config
from app.api.server import Limits, create_app
from app.client.engine_client import EngineClient
from app.options import KEY_VARIABLE
from app.window.api_bridge import ApiBridge, ApiRequest
from app.window.controller import ConversationController
from ui.main_window import MainWindow
from ui.serve_settings import ServeOptions

log = logging.getLogger(__name__)

STOP_S = 10.0  # uvicorn's graceful shutdown, then the thread is given this long to end
KEYS = ("serve/host", "serve/port", "serve/api_key")


class ApiServer:
    """uvicorn on a bound socket, in a thread; `stop` ends it and joins the thread."""

    def __init__(self, bridge: ApiBridge, options: ServeOptions, limits: Limits) -> None:
        self.listener = bound_listener(options.host, options.port)  # OSError: in use, ...
        self.port = int(self.listener.getsockname()[1])
        self.bridge = bridge
        app = create_app(bridge.engine, limits)
        config = uvicorn_config(app, options.host, self.port, limits, log_level="warning")
        config.timeout_graceful_shutdown = int(STOP_S / 2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run,
            kwargs={"sockets": [self.listener]},
            name="glassbox-api-server",
            daemon=True,
        )
        self.thread.start()

    @property
    def started(self) -> bool:
        return self.server.started

    def stop(self) -> None:
        self.bridge.close()  # every request under way ends: nothing waits for the GUI thread
        self.server.should_exit = True
        self.thread.join(STOP_S)
        self.listener.close()
        self.bridge.deleteLater()
        if self.thread.is_alive():
            log.error("the API server's thread did not stop within %.0f s", STOP_S)


class ServeSwitch(QObject):
    """The Serve action and the settings' serve section, kept in step with the server."""

    def __init__(
        self,
        window: MainWindow,
        worker: EngineClient,
        controller: ConversationController,
        qsettings: QSettings,
    ) -> None:
        super().__init__(window)
        self.window, self.worker, self.controller = window, worker, controller
        self.qsettings = qsettings
        self.server: ApiServer | None = None
        self.panel = window.settings_panel.serve
        self.action = QAction("Serve API", window)
        self.action.setCheckable(True)
        self.action.setToolTip(
            "Answer OpenAI-style requests with this window's model; each request opens its own"
            " conversation here"
        )
        self.action.toggled.connect(self._toggled)
        self.panel.set_action(self.action)
        self.panel.set_options(self._remembered())
        self.panel.changed.connect(self._remember)
        window.chat_menu.addSeparator()
        window.chat_menu.addAction(self.action)
        window.chat_toolbar.addAction(self.action)

    @property
    def serving(self) -> bool:
        return self.server is not None

    def stop(self) -> None:
        """Stop serving (quitting, or the switch turned off); the port is free after."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()
            log.info("stopped serving the API")
        self.action.setChecked(False)
        self.panel.set_editable(True)

    # -- the switch ------------------------------------------------------------------------

    def _toggled(self, on: bool) -> None:
        if on and self.server is None:
            self._start()
        elif not on and self.server is not None:
            self.stop()
            self.panel.set_status("Not serving.")
            self.window.show_status("Stopped serving the API.")

    def _start(self) -> None:
        options = self.panel.options()
        key = options.api_key or os.environ.get(KEY_VARIABLE) or None
        refusal = listen_refusal(options.host, key, "the API key field")
        if refusal is None and self.worker.info is None:
            refusal = "no model is loaded yet: load one, then serve it"
        if refusal is None:
            bridge = ApiBridge(self.window, self.worker, self._open_conversation)
            try:
                self.server = ApiServer(bridge, options, Limits(api_key=key))
            except OSError as error:
                bridge.close()
                bridge.deleteLater()
                refusal = cannot_listen(options.host, options.port, error)
        if refusal is not None:
            self._refuse(refusal)
            return
        assert self.server is not None  # started above
        url = f"http://{options.host}:{self.server.port}/v1"
        line = f"Serving at {url}" + (" (API key required)" if key else "")
        self.panel.set_status(line)
        self.panel.set_editable(False)
        self.window.show_status(line)
        log.info("%s", line)

    def _refuse(self, refusal: str) -> None:
        text = f"Not serving: {refusal}."
        self.action.setChecked(False)  # a refused start leaves the switch off
        self.panel.set_status(text, error=True)
        self.window.show_status(text, 20000)

    def _open_conversation(self, request: ApiRequest) -> None:
        ask = request.ask
        self.controller.open_api(ask.messages, ask.settings, ask.client)

    # -- settings --------------------------------------------------------------------------

    def _remembered(self) -> ServeOptions:
        default = ServeOptions()
        host, port, key = (self.qsettings.value(name) for name in KEYS)
        try:
            port_number = int(str(port)) if port is not None else default.port
        except ValueError:
            port_number = default.port
        return ServeOptions(
            str(host) if host else default.host,
            port_number if 0 < port_number < 65536 else default.port,
            str(key) if key else "",
        )

    def _remember(self) -> None:
        options = self.panel.options()
        for name, value in zip(KEYS, (options.host, options.port, options.api_key), strict=True):
            self.qsettings.setValue(name, value)
