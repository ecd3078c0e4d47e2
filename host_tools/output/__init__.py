"""Output: what leaves the host for people and programs, made safe.

textsafe (device-derived text shown escaped on terminals, in CSV cells and in
log lines) and finitejson (JSON without NaN or Infinity: null and a reason).
May import: nothing of the project but itself; every other role may import it.
"""
