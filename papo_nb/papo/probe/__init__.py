"""The gamma-zero probe: run-time evidence that the PAPO-G terms vanish from the gradient at gamma = eta = 0.

It sits beside the adapter, not in it: the core (``papo/``) never imports it. The trainer reaches it through one
observer hook (``PAPOGTrainer.probe``: ``pending``, ``observe(...)``, ``metrics()``), built by
``training_probe(args)`` when ``PAPOGConfig.require_gpu_contract_probe`` asks for it.

- ``gamma_zero.py``: ``GammaZeroProbe`` (the verdicts), ``ProbeEvidence``, ``probe_batches``;
- ``measure.py``: the gradients of one batch and every number the verdict reads;
- ``projection.py``: the projection test (leak coefficients against a measured noise floor, power by injection),
  over the whole gradient and per block (``blocks.py``: named parameter groups);
- ``threshold.py``: the detection threshold, a Student-t quantile that holds the false-alarm rate at 1e-3 per
  evaluation;
- ``roundoff.py``: where the roundoff sample comes from; ``reduce.py``: the same numbers on FSDP2 shards;
- ``contract.py``: the spec's tolerances.
"""

from .gamma_zero import PASS_RULE, GammaZeroProbe, ProbeEvidence, probe_batch, probe_batches
from .measure import ProbeFailure, gradient_tolerance, measure_gamma_zero, measure_gamma_zero_variants


def training_probe(args) -> GammaZeroProbe:
    """The in-training probe for a ``PAPOGConfig``: what the trainer observes its loss calls with."""
    return GammaZeroProbe(max_degenerate_batches=args.probe_max_degenerate_batches)


__all__ = [
    "PASS_RULE",
    "GammaZeroProbe",
    "ProbeEvidence",
    "ProbeFailure",
    "gradient_tolerance",
    "measure_gamma_zero",
    "measure_gamma_zero_variants",
    "probe_batch",
    "probe_batches",
    "training_probe",
]
