"""The notebook layer: `%openrl` magics, widgets, and the Jupyter server extension, over a client library
(`Lab`, `LabLease`) that also works without Jupyter."""

from openrl_lab.lab.client import Lab, LabLease
from openrl_lab.lab.connection import Connection, LabError, find_connection

__all__ = ["Connection", "Lab", "LabError", "LabLease", "find_connection"]
