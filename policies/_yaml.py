"""Safe YAML reading that also remembers the line of every key, so errors and provenance can say file:line.

Values come from ``yaml.safe_load`` only: a policy can never construct Python objects or import modules. The
line map comes from composing the same text with the safe loader (nodes only, nothing is constructed).
"""

from __future__ import annotations

from typing import Any

import yaml

Path_ = tuple[Any, ...]


class DuplicateKeyError(ValueError):
    def __init__(self, message: str, *, line: int, field: str) -> None:
        super().__init__(message)
        self.line = line
        self.field = field


class LineMap:
    """Maps a path into the loaded data (``("ops", "attention", "order", 2)``) to its 1-based line."""

    def __init__(self, lines: dict[Path_, int]) -> None:
        self._lines = lines

    def line(self, path: Path_) -> int | None:
        """Line of `path`, or of its closest ancestor that has one."""
        path = tuple(path)
        while True:
            if path in self._lines:
                return self._lines[path]
            if not path:
                return None
            path = path[:-1]


def _walk(node: yaml.Node, path: Path_, out: dict[Path_, int]) -> None:
    out.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                field = ".".join(str(p) for p in path + (key,))
                raise DuplicateKeyError(f"field {field}: duplicate key {key!r} (first at line {seen[key]}); YAML would "
                                        "silently keep only the last one, so write each key once",
                                        line=key_node.start_mark.line + 1, field=field)
            seen[key] = key_node.start_mark.line + 1
            out[path + (key,)] = key_node.start_mark.line + 1
            _walk(value_node, path + (key,), out)
            out[path + (key,)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, path + (i,), out)


def load_yaml_with_lines(text: str) -> tuple[Any, LineMap]:
    """Parse `text` safely; raise yaml.YAMLError on syntax errors (their marks carry the line)."""
    data = yaml.safe_load(text)
    node = yaml.compose(text, Loader=yaml.SafeLoader)  # same text parsed again: only nodes, nothing constructed
    lines: dict[Path_, int] = {}
    if node is not None:
        _walk(node, (), lines)
    return data, LineMap(lines)
