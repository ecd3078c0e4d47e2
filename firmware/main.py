# pansketch board main file: deploy/flash.sh copies it to the board as /main.py.
# Reads /pansketch.json and runs the counting/publishing loop forever
# (firmware/app.py). A bad config prints why and idles without the watchdog,
# so Ctrl-C in `mpremote` always reaches the REPL. docs/FIRMWARE.md has more.
from pansketch.firmware import app

app.main()
