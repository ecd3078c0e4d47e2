"""Guest-side driver for firmware tests: boot the app on fake hardware and
run its main loop in fake time. Import after sys.path has /src/fakes."""
import fakehw

app = None  # the running pansketch.firmware.app.App (or Idle)


def boot(path="/flash/pansketch.json", fs_root="/flash"):
    global app
    fakehw.install()
    import fakefs

    fakefs.install(fs_root)
    from pansketch.firmware import app as fwapp

    app = fwapp.boot(path)
    return app


def run(seconds, tick_ms=1000):
    """Run the main loop like pansketch.firmware.app.main does, for ``seconds`` of fake time."""
    from pansketch.firmware import app as fwapp

    end = fakehw.ms + int(seconds * 1000)
    while fakehw.ms < end:
        app.step()
        fwapp.sleep(app, tick_ms)


def steps(n):
    """n main-loop iterations without sleeping (fake time stands still)."""
    for _ in range(n):
        app.step()


def uart(lines, uid=1):
    import machine

    out = bytearray()
    for x in lines:
        out.extend(x.encode() if isinstance(x, str) else x)
        out.extend(b"\n")
    machine.uarts[uid].feed(out)


def drained(uid=1):
    import machine

    return machine.uarts[uid].any() == 0


def loop(seconds):
    """Run the main loop like pansketch.firmware.app.main does, honouring each step's sleep.

    A step that asks for no sleep (more work pending) costs 1 ms of fake time,
    so busy steps shift the loop's phase the way real work does.
    """
    from pansketch.firmware import app as fwapp

    end = fakehw.ms + int(seconds * 1000)
    while fakehw.ms < end:
        ms = app.step()
        if ms:
            fwapp.sleep(app, ms)
        else:
            fakehw.advance(1)


def scalars(obj):
    """Sorted (name, value) of an object's int/bool/None attributes."""
    out = []
    for k, v in obj.__dict__.items():
        if v is None or isinstance(v, int):
            out.append((k, v))
    out.sort()
    return out
