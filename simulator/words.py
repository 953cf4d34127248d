"""Words for messages: counts with the right plural ("1 microbatch", "2 microbatches")."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """``n`` and ``word``, pluralised in English (or with ``many`` when irregular)."""
    if n == 1:
        return f"{n:,} {word}"
    if many is None:
        many = word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")
    return f"{n:,} {many}"
