"""YAML from a user or a run directory, read within named limits.

yaml.safe_load runs no code, but it has no bound: a 501-byte document of nested aliases ("billion
laughs") stands for 10^9 values, which any later walk over it (an error message's repr, a copy,
the report) expands until memory runs out, and a 1 GB file is read and parsed whole. Here the text
is read up to MAX_BYTES, and the document is refused before it is built when its expanded form —
every alias counted as the copy it stands for — has more than MAX_NODES values or MAX_CHARS
characters of scalars; a recursive alias is refused too.
"""
from __future__ import annotations

import os
import stat
from typing import Any

import yaml

MAX_BYTES = 1 << 20          # 1 MiB: the largest config here is a few KiB
MAX_NODES = 100_000          # values in the expanded document
MAX_CHARS = 4 << 20          # characters of scalars in the expanded document


class YamlLimit(ValueError):
    """A document over one of the limits; str() names the limit."""


class _BoundedLoader(yaml.SafeLoader):
    def construct_document(self, node):
        _expanded_size(node)
        return super().construct_document(node)


def _expanded_size(root) -> None:
    """Nodes and scalar characters of the document with every alias expanded, counted once per
    distinct node (memoised), so the count itself costs the size of the text, not of the expansion."""
    memo, active = {}, set()

    def size(node):
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:
            raise YamlLimit("a recursive alias (a value that contains itself) is not allowed")
        active.add(key)
        nodes, chars = 1, 0
        if isinstance(node, yaml.ScalarNode):
            chars = len(node.value)
        else:
            children = node.value if isinstance(node, yaml.SequenceNode) else [c for kv in node.value for c in kv]
            for child in children:
                n, c = size(child)
                nodes, chars = nodes + n, chars + c
                if nodes > MAX_NODES:
                    raise YamlLimit(f"it expands to more than {MAX_NODES} values "
                                    "(aliases counted as copies; the limit)")
                if chars > MAX_CHARS:
                    raise YamlLimit(f"it expands to more than {MAX_CHARS} characters "
                                    "(aliases counted as copies; the limit)")
        active.discard(key)
        memo[key] = (nodes, chars)
        return memo[key]

    size(root)


def load(data: bytes) -> Any:
    """The document in `data` (UTF-8), within the limits; YamlLimit, yaml.YAMLError or
    UnicodeDecodeError otherwise."""
    if len(data) > MAX_BYTES:
        raise YamlLimit(f"it is larger than {MAX_BYTES} bytes (the limit)")
    return yaml.load(data.decode("utf-8"), Loader=_BoundedLoader)


def read(path: str, regular_only: bool = True) -> bytes:
    """Up to MAX_BYTES of the file (YamlLimit beyond). regular_only: a FIFO or a device is refused
    (a run directory's file); a user's own --config may be a pipe."""
    flags = os.O_RDONLY | (os.O_NONBLOCK if regular_only else 0)
    fd = os.open(path, flags)
    try:
        if regular_only and not stat.S_ISREG(os.fstat(fd).st_mode):
            raise YamlLimit("it is not a regular file")
        chunks, size = [], 0
        while size <= MAX_BYTES:
            chunk = os.read(fd, min(1 << 20, MAX_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_BYTES:
        raise YamlLimit(f"it is larger than {MAX_BYTES} bytes (the limit)")
    return data
