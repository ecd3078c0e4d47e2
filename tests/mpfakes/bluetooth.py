"""Fake ``bluetooth`` for both test VMs: a BLE object whose scans run on the radio
of ``fakehw`` (in the WebAssembly VM a test fills them with adverts, ``burst``;
on the Unix-port board they end at once, having heard nothing)."""
import fakehw

_IRQ_SCAN_RESULT = 5
_IRQ_SCAN_DONE = 6
_ble = [None]


def burst(addrs, addr_type=0, end=True):
    """Test hook: the scan hears ``addrs`` (6-byte bytes each), then ends (unless end=False)."""
    b = _ble[0]
    for a in addrs:
        b._irq(_IRQ_SCAN_RESULT, (addr_type, memoryview(a), 0, -60, memoryview(b"\x02\x01\x06")))
    if end:
        b._done()


class BLE:
    def __init__(self):
        self._active = False
        self._irq = None
        self.scanning = False
        _ble[0] = self

    def active(self, v=None):
        if v is None:
            return self._active
        self._active = bool(v)

    def irq(self, handler):
        self._irq = handler

    def gap_scan(self, duration_ms, interval_us=1280000, window_us=11250, active=False):
        if duration_ms is None:
            self.scanning = False
            return
        self.scanning = True
        fakehw.ble_scan(self, duration_ms, interval_us, window_us, active)

    def _done(self):
        if self.scanning:
            self.scanning = False
            if self._irq is not None:
                self._irq(_IRQ_SCAN_DONE, ())
