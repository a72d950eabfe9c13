"""Library versions, for device probes and version requirements."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Mapping

from packaging.version import InvalidVersion, Version


def version_tuple(text: str | None) -> tuple[int, ...]:
    """The leading numeric release of a version string: "2.7.0.post2" → (2, 7, 0), "9.19.0+cu13" → (9, 19, 0),
    "0.1.dev1+g123" → (0, 1); () for None, "" or text without a leading number. Compares like releases do."""
    if not text:
        return ()
    try:
        return tuple(Version(text).release)
    except InvalidVersion:
        pass
    out = []
    for part in text.split("+")[0].split("."):
        digits = ""
        for ch in part:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        out.append(int(digits))
        if len(digits) != len(part):
            break
    return tuple(out)


def at_least(version: str | None, minimum: str) -> bool:
    """Whether `version` (None: unknown) is `minimum` or newer, by numeric release; an unknown version is not."""
    return version is not None and version_tuple(version) >= version_tuple(minimum)


def installed_versions(distributions: Iterable[str] | Mapping[str, str]) -> dict[str, str]:
    """{key: version} of the pip distributions that are installed, without importing them. A mapping gives
    {key: distribution name} (``{"flash_attn": "flash-attn"}``); an iterable uses each name as its own key."""
    pairs = distributions.items() if isinstance(distributions, Mapping) else ((d, d) for d in distributions)
    found = {}
    for key, dist in pairs:
        try:
            found[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found
