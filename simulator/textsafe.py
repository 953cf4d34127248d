"""Text from user files on a terminal: no control sequences, no rich markup.

Names come from scenario files, traces and logs. Printed raw, an ESC or OSC sequence could retitle
or rewrite the user's terminal, and a ``[/bold]`` would be parsed by rich as markup (and crash it).
"""

from __future__ import annotations

import re

# C0 controls except tab, and DEL and the C1 range (ESC, CSI and OSC introducers among them).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def plain(text: object) -> str:
    """``text`` with control characters shown as \\xNN escapes."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))


def for_rich(text: object) -> str:
    """``text`` safe to hand to rich: control characters escaped, markup brackets escaped."""
    from rich.markup import escape

    return escape(plain(text))
