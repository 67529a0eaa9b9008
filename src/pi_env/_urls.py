"""How a URL is shown (errors, reasons, records, reprs): its user:password masked. The one home of
that rule, on the bottom layer, so the gateway and the value types share it without either
importing the other (and without `import pi_env.config` loading the gateway)."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"//[^/@\s]*@")


def without_userinfo(text: str) -> str:
    """`text` with the `//user:password@` of any URL in it masked."""
    return _USERINFO.sub("//***@", text)
