"""Tag types of the RAPIDS ucxx API.

``Tag`` and ``TagMask`` are ``int`` subclasses restricted to 64 bits: every
call that takes a tag takes either an int or one of these (no conversion
happens on the transfer path), and they compare and hash as the int they
hold.
"""

from __future__ import annotations

__all__ = ["Tag", "TagMask", "TagMaskFull"]

_MAX = (1 << 64) - 1


class _U64(int):
    __slots__ = ()

    def __new__(cls, value: int = 0):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"{cls.__name__} takes an int, not {type(value).__name__}"
            )
        if not 0 <= value <= _MAX:
            raise OverflowError(
                f"{cls.__name__} must be in 0..2**64-1, got {value}"
            )
        return super().__new__(cls, value)

    @property
    def value(self) -> int:
        """The tag as a plain int."""
        return int(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({int(self)})"

    __str__ = __repr__


class Tag(_U64):
    """A 64-bit message tag."""

    __slots__ = ()


class TagMask(_U64):
    """A 64-bit mask of the tag bits a receive matches."""

    __slots__ = ()


TagMaskFull = TagMask(_MAX)
