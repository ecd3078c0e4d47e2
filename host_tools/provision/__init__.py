"""Provision: what a user installs onto boards and hosts.

fitcheck (does a board config fit the board in the code form it will be
flashed: `pansketch fit`, called by deploy/flash.sh) and initdir (the example
configs, units and flashing script `pansketch init DIR` writes).
May import: agent and firmware (the board's memory model); nothing of host_tools.
"""
