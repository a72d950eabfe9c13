"""Plugin contract and entry-point loading.

Third-party vendors and opdispatch's built-in vendors use the same contract (``opdispatch.plugins.hookspec``)
and the same entry-point group (``opdispatch.plugins``).
"""

from opdispatch.base._entry_points import ENTRY_POINT_GROUP

from ._loader import PluginRecord, load_entry_point_plugins
from .hookspec import hookimpl

__all__ = ["ENTRY_POINT_GROUP", "PluginRecord", "hookimpl", "load_entry_point_plugins"]
