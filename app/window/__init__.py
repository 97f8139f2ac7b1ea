"""The window as a program: its assembly from widgets and the engine client, start-up, the
controller between the conversation and the store, and quitting cleanly."""
