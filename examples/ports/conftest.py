"""The ports are scripts, run by ``tests/test_ports.py``; pytest does not collect them here."""

collect_ignore_glob = ["*.py"]
