"""Subcommands of the `ptq` CLI (see ptq/cli.py)."""
