"""The in-training gamma-zero probe's state in every checkpoint, so that a resumed run keeps its verdict.

The probe (``papo_nb.papo.probe.gamma_zero.GammaZeroProbe``) runs until it gives one verdict, then stops. A resumed
trainer builds a fresh probe, which would probe the first resumed step again and log its ``probe/*`` metrics there:
the resumed run's metrics would differ from an uninterrupted run's. ``ProbeStateCallback`` writes the probe's
counters and evidence next to each checkpoint (``papo_probe_state.json``, rank 0; the evidence is the same on every
rank) and ``restore_probe`` puts them back before a resume trains. A checkpoint without the file (an older run) leaves
the probe fresh, as before.
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import TrainerCallback

from papo_nb.papo.probe.gamma_zero import ProbeEvidence
from papo_nb.train.run_folder import write_atomic
from papo_nb.workbook.training.checkpoints import CHECKPOINT_PREFIX

PROBE_STATE_FILE = "papo_probe_state.json"
PROBE_COUNTERS = (
    "pending",
    "degenerate_batches",
    "underpowered_batches",
    "batches_without_images",
    "evaluations",
    "measurements",
)
DERIVED = ("passed", "underpowered")  # properties ``ProbeEvidence.to_dict`` adds


class ProbeStateCallback(TrainerCallback):
    """Writes the probe's state into each checkpoint the Trainer saves."""

    def __init__(self, probe):
        self.probe = probe

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{CHECKPOINT_PREFIX}{state.global_step}"
            saved = {name: getattr(self.probe, name) for name in PROBE_COUNTERS}
            saved["evidence"] = self.probe.evidence.to_dict() if self.probe.evidence is not None else None
            write_atomic(folder / PROBE_STATE_FILE, json.dumps(saved))  # NaN stays a number (Python's JSON)


def restore_probe(probe, checkpoint: Path) -> bool:
    """Put the probe's state saved in ``checkpoint`` back; returns whether the checkpoint held one."""
    path = Path(checkpoint) / PROBE_STATE_FILE
    if not path.is_file():
        return False
    saved = json.loads(path.read_text())
    for name in PROBE_COUNTERS:
        setattr(probe, name, saved[name])
    evidence = saved["evidence"]
    probe.evidence = (
        None if evidence is None else ProbeEvidence(**{k: v for k, v in evidence.items() if k not in DERIVED})
    )
    return True
