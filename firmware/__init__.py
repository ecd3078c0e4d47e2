"""pansketch board firmware (MicroPython): app (the main loop), config, clock, wifi, mqtt, memory and the event sources; imports agent, never host_tools."""
