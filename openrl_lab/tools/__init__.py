"""Maintenance commands run from a checkout (`python -m openrl_lab.tools.<name>`)."""
