"""Kubernetes resource quantities (`4Gi`, `4096Mi`, `1.5G`, `30`, `500m`, `1e3`) read exactly (pure).

The grammar is apimachinery's `resource.ParseQuantity`: a signed decimal number, then a binary suffix (Ki .. Ei),
a decimal suffix (n, u, m, k, M, G, T, P, E) or an exponent (`e3`, `E-2`). Values are `Decimal`s, so nothing
is rounded on the way; callers decide what an amount that is not whole means.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))([a-zA-Z]{0,2}|[eE][+-]?\d+)$")
_SUFFIXES = {
    "": Decimal(1),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
}


class QuantityError(ValueError):
    """Text that is not a Kubernetes quantity."""


def parse_quantity(value: object) -> Decimal:
    """The amount a quantity stands for (bytes for memory, plain units otherwise); QuantityError names the text."""
    if isinstance(value, bool):
        raise QuantityError(f"{value!r} is not a quantity")
    if isinstance(value, int):
        return Decimal(value)
    text = str(value).strip()
    match = _QUANTITY.match(text)
    if match is None:
        raise QuantityError(f"{text!r} is not a Kubernetes quantity (e.g. 4Gi, 4096Mi, 30)")
    number, suffix = match.groups()
    try:
        amount = Decimal(number)
    except InvalidOperation:
        raise QuantityError(f"{text!r} is not a Kubernetes quantity") from None
    if suffix[:1] in ("e", "E") and suffix[1:].lstrip("+-").isdigit():
        return amount.scaleb(int(suffix[1:]))
    if suffix not in _SUFFIXES:
        raise QuantityError(f"{text!r} has an unknown suffix {suffix!r} (Ki, Mi, Gi, Ti, k, M, G, T, m, ...)")
    return amount * _SUFFIXES[suffix]


def mib_quantity(mib: int) -> str:
    """MiB as a quantity in the largest binary unit that holds it exactly (`16384` -> `16Gi`, `1536` -> `1536Mi`)."""
    if mib and mib % 1024 == 0:
        return f"{mib // 1024}Gi"
    return f"{mib}Mi"
