"""Helpers the tests share: real services (broker, database, VMs), fixtures' data, scenario
scripts. Nothing here is collected as a test; a test file imports from here, never from another
test file. May import: agent, host_tools, firmware (read as files), the standard library, pytest."""
