"""revert_fix puts exact source lines back, refuses a drifted source, and restores."""

from __future__ import annotations

import pytest
from source_patch import FixNotFound, revert_fix


class Base:
    def size(self) -> int:
        return 1


class Pool(Base):
    def size(self) -> int:
        n = super().size()
        return n + 1  # the fix

    @staticmethod
    def clamp(x: int, hi: int = 4) -> int:
        return min(x, hi)


def test_reverts_a_method_with_zero_argument_super_and_restores() -> None:
    original = Pool.size
    with revert_fix(Pool.size, fixed="return n + 1  # the fix", buggy="return n + 10"):
        assert Pool().size() == 11
    assert Pool.size is original and Pool().size() == 2


def test_staticmethod_keeps_its_defaults() -> None:
    with revert_fix(Pool.clamp, fixed="min(x, hi)", buggy="max(x, hi)"):
        assert Pool.clamp(2) == 4 and Pool.clamp(9) == 9
    assert Pool.clamp(9) == 4


def test_drifted_source_fails_loudly() -> None:
    with (pytest.raises(FixNotFound, match="occur 0 times"),
          revert_fix(Pool.size, fixed="return n + 2", buggy="return n")):
        pass
    assert Pool().size() == 2
