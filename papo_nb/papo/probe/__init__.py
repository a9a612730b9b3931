"""The gamma-zero probe: run-time evidence that the PAPO-G terms vanish from the gradient at gamma = eta = 0.

It sits beside the adapter, not in it: the core (``papo/``) never imports it. The trainer reaches it through one
observer hook (``PAPOGTrainer.probe``: ``pending``, ``observe(...)``, ``metrics()``), built by
``training_probe(args, model)`` when ``PAPOGConfig.require_gpu_contract_probe`` asks for it (refused, naming the
parameter, where the model has more trainable parameters than its float64 vectors can hold).

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

# The probe holds up to this many float64 vectors of every trainable parameter at once (the parent's, the zero-gamma
# and term gradients, the roundoff sample): 12-24 of them, about 30 GB each under full fine-tuning at 3B.
PROBE_FLOAT64_VECTORS = 24
# Above this many trainable parameters the probe refuses: 24 x 8 bytes x 1e8 is about 18 GiB beside the run.
PROBE_MAX_TRAINABLE_PARAMETERS = 100_000_000


def oversized_problem(model) -> str | None:
    """Why the probe cannot run on ``model`` (too many trainable parameters for its float64 vectors), or None."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if trainable <= PROBE_MAX_TRAINABLE_PARAMETERS:
        return None
    need = PROBE_FLOAT64_VECTORS * 8 * trainable / 1024**3
    return (
        f"PAPOGConfig.require_gpu_contract_probe=True (workbook parameter 'require_gpu_contract_probe') cannot run "
        f"here: the model has {trainable:,} trainable parameters, above the probe's limit of "
        f"{PROBE_MAX_TRAINABLE_PARAMETERS:,}; it holds up to {PROBE_FLOAT64_VECTORS} float64 vectors of every "
        f"trainable parameter, {need:,.1f} GiB for this model. Set require_gpu_contract_probe=False for this run, "
        "and run the probe where it fits: LoRA (finetuning 'lora') or the CPU recipe (params/recipes/tiny_cpu.yaml)"
    )


def training_probe(args, model=None) -> GammaZeroProbe:
    """The in-training probe for a ``PAPOGConfig``: what the trainer observes its loss calls with. Given the
    trainer's ``model``, refused (ValueError, before any step) where its vectors do not fit (``oversized_problem``)."""
    problem = oversized_problem(model) if model is not None else None
    if problem:
        raise ValueError(problem)
    return GammaZeroProbe(max_degenerate_batches=args.probe_max_degenerate_batches)


__all__ = [
    "PASS_RULE",
    "PROBE_FLOAT64_VECTORS",
    "PROBE_MAX_TRAINABLE_PARAMETERS",
    "GammaZeroProbe",
    "ProbeEvidence",
    "ProbeFailure",
    "gradient_tolerance",
    "measure_gamma_zero",
    "measure_gamma_zero_variants",
    "oversized_problem",
    "probe_batch",
    "probe_batches",
    "training_probe",
]
