"""Fake ``bluetooth`` for the Unix-port board: a radio that never hears anything."""


class BLE:
    def __init__(self):
        self._active = False
        self._irq = None

    def active(self, v=None):
        if v is None:
            return self._active
        self._active = bool(v)

    def irq(self, handler):
        self._irq = handler

    def gap_scan(self, duration_ms, interval_us=1280000, window_us=11250, active=False):
        if duration_ms is not None and self._irq is not None:
            self._irq(6, ())  # _IRQ_SCAN_DONE at once: nothing heard
