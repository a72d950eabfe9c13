"""Checking a vendor function's keywords before calling it (closed-source libraries change them between releases)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any


def unaccepted_keywords(fn: Any, keywords: Iterable[str]) -> list[str]:
    """The `keywords` that `fn` does not accept by name — empty when it takes ``**kwargs`` or its signature cannot
    be read (a C++ builtin): then only the call itself can tell."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return []
    named = {n for n, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                        inspect.Parameter.KEYWORD_ONLY)}
    return [k for k in keywords if k not in named]



def unaccepted_keywords_reason(fn: Any, keywords: Iterable[str], name: str) -> str | None:
    """Why a vendor function `name` cannot take the call this adapter makes (the `keywords` it passes that `fn`
    refuses, with its signature), or None — an adapter's `extra_availability`."""
    missing = unaccepted_keywords(fn, keywords)
    if not missing:
        return None
    return f"{name} does not accept the keywords {missing} this adapter passes; signature {inspect.signature(fn)}"
