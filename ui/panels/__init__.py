"""Live views of what the model does while a reply streams: timing, KV cache, attention,
next-token candidates and the roofline, fed from engine events and redrawn by a timer.

`state` holds what they draw, without Qt; `docks` builds the panels, their docks and the timer.
"""
