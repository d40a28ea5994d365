"""Synthetic workloads for ``kvcanary run`` / ``bench``: seeded, so runs are reproducible.

Every prompt is ``shared prefix (shared_prefix_len) + own suffix``; prompt lengths vary
uniformly in ``[input_len/2, input_len]`` but never below the shared prefix + 1.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvcanary.utils import show


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int = 32
    input_len: int = 256
    output_len: int = 64
    shared_prefix_len: int = 128
    seed: int = 0

    @classmethod
    def from_flags(cls, num_requests: int, input_len: int, output_len: int,
                   shared_prefix_len: int | None, seed: int) -> WorkloadSpec:  # fmt: skip
        """The spec of the command-line flags: ``--shared-prefix-len`` not given defaults to
        :func:`default_shared_prefix_len` of ``--input-len`` (a given one is checked)."""
        if shared_prefix_len is None:
            shared_prefix_len = default_shared_prefix_len(input_len)
        return cls(num_requests, input_len, output_len, shared_prefix_len, seed)

    def __post_init__(self) -> None:
        for name, lo in (("num_requests", 1), ("input_len", 1), ("output_len", 1), ("shared_prefix_len", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < lo:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag}={show(v)} is invalid: allowed an integer >= {lo}")
        if self.shared_prefix_len >= self.input_len:
            raise ValueError(
                f"--shared-prefix-len={self.shared_prefix_len} is invalid: allowed values "
                f"< --input-len ({self.input_len})"
            )


def default_shared_prefix_len(input_len: int) -> int:
    """Half of ``input_len``, at most the dataclass default (128): valid for any
    ``input_len >= 1``."""
    default = WorkloadSpec.__dataclass_fields__["shared_prefix_len"].default
    assert isinstance(default, int)
    return max(0, min(default, input_len // 2))


def make_prompts(spec: WorkloadSpec, vocab_size: int) -> list[list[int]]:
    """Token-id prompts over ``[0, min(vocab_size, 256))`` (bytes for byte tokenizers)."""
    rng = random.Random(spec.seed)
    hi = min(vocab_size, 256)
    shared = [rng.randrange(hi) for _ in range(spec.shared_prefix_len)]
    prompts = []
    for _ in range(spec.num_requests):
        lo = max(spec.input_len // 2, spec.shared_prefix_len + 1)
        n = rng.randint(lo, spec.input_len)
        prompts.append(shared + [rng.randrange(hi) for _ in range(n - len(shared))])
    return prompts
