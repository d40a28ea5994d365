"""Fault injection for the canary's self-test (SGLang's perturb modes plus kvcanary's own).

:mod:`.config` (PerturbConfig, modes), :mod:`.expectations` (what each fault must produce),
:mod:`.slots` (where a fault can land), :mod:`.faults` (the faults), :mod:`.manager`
(Perturber, install_perturbation).
"""

from kvcanary.canary.perturb.config import PERTURB_MODES, PerturbConfig, PerturbMode
from kvcanary.canary.perturb.expectations import ExpectedDetection, applies_to, expected_detection
from kvcanary.canary.perturb.faults import Injection
from kvcanary.canary.perturb.manager import Perturber, install_perturbation

__all__ = [
    "PERTURB_MODES", "ExpectedDetection", "Injection", "PerturbConfig", "PerturbMode",
    "Perturber", "applies_to", "expected_detection", "install_perturbation",
]  # fmt: skip
