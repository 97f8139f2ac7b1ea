"""An OpenAI-compatible HTTP server over the one loaded model (`glassbox serve`): the same
session and events as the window and the terminal chat, one generation at a time, requests
waiting in a bounded FIFO queue. Never imports Qt."""
