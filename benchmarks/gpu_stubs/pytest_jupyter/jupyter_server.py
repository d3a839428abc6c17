"""Empty stand-in for pytest-jupyter's jupyter_server plugin (see __init__.py): it defines no fixtures."""
