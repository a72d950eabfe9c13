"""Safe YAML reading that also remembers the line of every key, so errors and provenance can say file:line.

The text is parsed once, into nodes (libyaml's C parser when PyYAML has it), and the values are constructed
from those nodes with the safe constructor: a policy can never construct Python objects or import modules.
Before anything is constructed the node graph is checked: a recursive alias is refused, and so is a document
that aliases would expand beyond `MAX_NODES` nodes or `MAX_DEPTH` levels (an "alias bomb" of a few hundred
bytes can otherwise expand to gigabytes) — each with the line where it happens.
"""

from __future__ import annotations

from typing import Any

import yaml

Path_ = tuple[Any, ...]

# A real policy has a few thousand nodes (a 20,000-rule file about 200,000); these bound what aliases may
# multiply it to, and how deep it may nest, well above that.
MAX_NODES = 2_000_000
MAX_DEPTH = 200

_Loader: type = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class YamlStructureError(ValueError):
    """A YAML document refused before construction (duplicate key, recursive alias, too large, too deep)."""

    def __init__(self, message: str, *, line: int | None, field: str | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.field = field


DuplicateKeyError = YamlStructureError  # the name earlier callers catch


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


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _expanded_sizes(root: yaml.Node) -> None:
    """Refuse recursive aliases and documents that expand too far; sizes are memoised per node, so a shared
    (aliased) subtree is measured once however often it is used."""
    sizes: dict[int, int] = {}
    depths: dict[int, int] = {}
    on_path: set[int] = set()
    # Iterative post-order walk: deep documents must not exhaust Python's own recursion limit.
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            children = _children(node)
            size = 1 + sum(sizes[id(c)] for c in children)
            depth = 1 + max((depths[id(c)] for c in children), default=0)
            if size > MAX_NODES:
                raise YamlStructureError(f"the document expands to more than {MAX_NODES:,} nodes through aliases "
                                         "(an alias bomb?); write the values out or use fewer nested aliases",
                                         line=_line(node))
            if depth > MAX_DEPTH:
                raise YamlStructureError(f"the document nests deeper than {MAX_DEPTH} levels; a policy needs a "
                                         "handful", line=_line(node))
            sizes[key], depths[key] = size, depth
            continue
        if key in sizes:
            continue
        if key in on_path:
            raise YamlStructureError("a recursive alias (a node that contains itself) cannot be a policy value",
                                     line=_line(node))
        on_path.add(key)
        stack.append((node, True))
        if len(on_path) > MAX_DEPTH:
            raise YamlStructureError(f"the document nests deeper than {MAX_DEPTH} levels; a policy needs a handful",
                                     line=_line(node))
        for child in _children(node):
            if id(child) not in sizes:
                stack.append((child, False))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _walk(node: yaml.Node, path: Path_, out: dict[Path_, int], seen_nodes: set[int], depth: int) -> None:
    """Record the line of every path; an aliased subtree is walked once (its first path), duplicate keys refused."""
    out.setdefault(path, _line(node))
    if depth > MAX_DEPTH:
        raise YamlStructureError(f"the document nests deeper than {MAX_DEPTH} levels; a policy needs a handful",
                                 line=_line(node))
    if id(node) in seen_nodes:
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                field = ".".join(str(p) for p in path + (key,))
                raise YamlStructureError(
                    f"field {field}: duplicate key {key!r} (first at line {seen[key]}); YAML would silently keep "
                    "only the last one, so write each key once", line=_line(key_node), field=field)
            seen[key] = _line(key_node)
            out[path + (key,)] = _line(key_node)
            _walk(value_node, path + (key,), out, seen_nodes, depth + 1)
            out[path + (key,)] = _line(key_node)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, path + (i,), out, seen_nodes, depth + 1)


def load_yaml_with_lines(text: str) -> tuple[Any, LineMap]:
    """Parse `text` once, safely; raise yaml.YAMLError on syntax errors (their marks carry the line) and
    YamlStructureError for duplicate keys, recursive aliases, alias bombs and excessive nesting."""
    loader = _Loader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:  # the pure-Python composer recurses per level
            raise YamlStructureError(f"the document nests deeper than {MAX_DEPTH} levels; a policy needs a handful",
                                     line=None) from None
        lines: dict[Path_, int] = {}
        if node is None:
            return None, LineMap(lines)
        if "&" in text:  # aliases need an anchor: without one nothing can expand (the common, fast case)
            _expanded_sizes(node)
        _walk(node, (), lines, set(), 0)
        data = loader.construct_document(node)
    finally:
        loader.dispose()
    return data, LineMap(lines)
