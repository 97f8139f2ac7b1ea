"""What the engine measures about the machine and a step: devices and their clocks, the
machine's peaks, and the roofline a step is placed on."""
