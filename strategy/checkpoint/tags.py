"""Checkpoint tags: which names are allowed, and which checkpoint to load (``resolve_tag``, shared
by ``load_ckpt`` and the offline export)."""

from __future__ import annotations

import os
import re
from typing import Any

from strategy.checkpoint.layout import HF_SUFFIX, LATEST, complete_tags, read_meta
from strategy.errors import fail

_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=-]{0,199}")
RESERVED = (LATEST, "latest_universal")


def validate_tag(tag: Any) -> str:
    """A tag is one plain path component, so it cannot escape ``save_dir``.

    Args:
        tag: the proposed tag (converted with ``str``).

    Returns:
        The tag as a string.

    Raises:
        ConfigError: it is not one plain directory name, or it is reserved (``latest``,
            ``latest_universal``, a name ending in ``_hf``).
    """
    tag = str(tag)
    if not _TAG.fullmatch(tag):
        fail("tag", tag, "use letters, digits and _ . + = - only, starting with a letter or digit "
             "(one directory name inside save_dir)")
    if tag in RESERVED or tag.endswith(HF_SUFFIX):
        fail("tag", tag, f"'latest', 'latest_universal' and names ending in {HF_SUFFIX!r} are "
             "reserved; pick another")
    return tag


def _read_latest(load_dir: str) -> str | None:
    try:
        with open(os.path.join(load_dir, LATEST)) as fh:
            return fh.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None


def resolve_tag(load_dir: str, tag: str | None) -> str | None:
    """The complete checkpoint to load: ``tag`` (it must be complete), else the one ``latest``
    names if complete, else the newest complete one.

    Args:
        load_dir: the directory holding the checkpoints.
        tag: the checkpoint asked for, or None for the newest.

    Returns:
        The tag, or None when ``load_dir`` holds no complete checkpoint.

    Raises:
        ConfigError: ``tag`` is invalid or names no complete checkpoint.
    """
    if tag is not None:
        tag = validate_tag(tag)
        if read_meta(os.path.join(load_dir, tag)) is None:
            fail("tag", tag, f"{load_dir} holds no complete checkpoint of that name; use one of "
                 f"{complete_tags(load_dir)}")
        return tag
    latest = _read_latest(load_dir)
    if latest and _TAG.fullmatch(latest) and read_meta(os.path.join(load_dir, latest)) is not None:
        return latest
    done = complete_tags(load_dir)
    return done[-1] if done else None


def node_view(load_dir: str) -> tuple[str | None, list[str]]:
    """What one node's copy of ``load_dir`` holds: the tag ``latest`` names (if complete) and its
    complete tags, oldest first."""
    done = complete_tags(load_dir)
    latest = _read_latest(load_dir)
    return (latest if latest in done else None), done


def resolve_common_tag(views: list[tuple[str | None, list[str]]], load_dir: str,
                       tag: str | None) -> str | None:
    """``resolve_tag`` over every node's copy (``node_view`` of each): the checkpoint complete on
    all of them. A save killed on one node leaves a tag the others published: it is passed over."""
    common = [name for name in views[0][1] if all(name in done for _, done in views[1:])]
    if tag is not None:
        tag = validate_tag(tag)
        if tag not in common:
            fail("tag", tag, f"{load_dir} holds no checkpoint of that name complete on every node; "
                 f"use one of {common}")
        return tag
    latests = {latest for latest, _ in views}
    if len(latests) == 1 and None not in latests and latests <= set(common):
        return latests.pop()
    return common[-1] if common else None
