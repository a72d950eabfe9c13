"""The entry-point group plugins register under (``[project.entry-points."opdispatch.plugins"]``).

Shared by the device layer (a vendor name may be a plugin's) and the plugin loader; it imports nothing, so the
loader — imported by ``import opdispatch`` through ``hookimpl`` — stays free of torch, pydantic and yaml.
"""

ENTRY_POINT_GROUP = "opdispatch.plugins"
