"""Prefix sharing with several processes (issue 55 item 4): two gloo processes (DDP) under torchrun, each rank
training ``PAPOGTrainer.train()`` on the float64 tiny Qwen2.5-VL with TRL's default gradient checkpointing and the
in-training gamma-zero probe on (``tests/sharing_worker.py``). Sharing on against the plain forward with the same
whole-group shuffle: parameters after two SGD steps equal within ``PARAMETER_BOUND`` on both ranks, every log-prob
call packed, each micro-batch whole prompt groups, the round's advantages the same as TRL's own run (sharing off),
the probe passed, and each rank's forward plan and log saying it packed its own groups. Under FSDP2's
``fully_shard`` (per block, then the root) one micro-batch's loss and gradient shards through the trainer's
``_compute_loss`` equal the plain forward's, and the ranks agree on each call (a rank's own reason, unequal chunk
counts or a failed first-batch check on one rank send every rank to the plain path). ``split_batches`` is refused.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_prefix_sharing_checkpointing import PARAMETER_BOUND

from papo_nb.papo import PAPOGConfig
from papo_nb.prefix_sharing import sharing as prefix_sharing
from papo_nb.prefix_sharing import trl_seams
from papo_nb.testbed.models import build_tiny_vlm, load_vlm

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "sharing_worker.py"
GENERATIONS = 4  # the worker's num_generations and per_device_train_batch_size
JOB_TIMEOUT = 300  # seconds: the job takes about 40 s on a quiet 2-core machine
RANKS_PHRASE = "2 processes, each rank packing the whole prompt groups it holds"
FSDP_GRADIENT_BOUND = 1e-10  # float64 gradient shards and losses, packed against plain, under FSDP2 (max abs)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' records of one 2-process torchrun job of the worker."""
    from papo_nb.infra.servers import free_port

    folder = build_tiny_vlm("qwen2_5_vl", cache_dir=tmp_path_factory.mktemp("m"))
    out = tmp_path_factory.mktemp("ranks")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["--master_port", str(free_port("127.0.0.1")), str(WORKER), "--model", str(folder), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.slow
@pytest.mark.model
def test_two_gloo_ranks_train_with_sharing_as_the_plain_forward(ranks):
    release_reason = trl_seams.packed_path_reason()
    for record in ranks:
        shared, plain, trl = record["shared"], record["plain"], record["trl"]
        assert record["world"] == 2 and record["backend"] == "gloo" and shared["distributed_type"] == "MULTI_CPU"
        print(f"rank {record['rank']}: parameters moved by up to {shared['moved']:.2e}, shared vs plain differ by "
              f"{record['difference']:.2e}; {shared['plan']}")  # fmt: skip
        assert shared["moved"] > 1e3 * PARAMETER_BOUND and record["difference"] <= PARAMETER_BOUND
        assert shared["probe"]["status"] == plain["probe"]["status"] == "passed", shared["probe"]["message"]
        assert shared["advantages"] == plain["advantages"] == trl["advantages"], "the round's advantages unchanged"
        if release_reason is not None:  # TRL 1.14+: TRL's own forward ran, and the plan says why
            assert shared["log_prob_forward"] == "plain per completion" and set(shared["shared_flags"]) <= {0.0}
            continue
        assert shared["log_prob_forward"] == "packed per prompt group" and RANKS_PHRASE in shared["plan"]
        assert shared["shared_flags"] and set(shared["shared_flags"]) == {1.0}, "every log-prob call packed"
        assert any(line.startswith("PAPO-G forward plan at train() start") and RANKS_PHRASE in line
                   for line in shared["plan_lines"]), shared["plan_lines"]  # fmt: skip
        assert shared["group_sizes"] and all(sizes == [GENERATIONS] for sizes in shared["group_sizes"])
    # what TRL's row shuffle does to a rank's groups (the same draw): it splits them across micro-batches
    assert any(sizes != [GENERATIONS] for record in ranks for sizes in record["trl"]["group_sizes"])
    assert ranks[0]["shared"]["digest"] == ranks[1]["shared"]["digest"], "DDP keeps the ranks' parameters equal"


@pytest.mark.slow
@pytest.mark.model
def test_under_fsdp2_each_rank_packs_its_groups_as_the_plain_forward_and_the_ranks_agree(ranks):
    release_reason = trl_seams.packed_path_reason()
    for record in ranks:
        fsdp2 = record["fsdp2"]
        print(f"rank {record['rank']} FSDP2: gradient shards differ by {fsdp2['grad_difference']:.2e} (largest "
              f"{fsdp2['grad_size']:.2e}), losses by {fsdp2['loss_difference']:.1e}")  # fmt: skip
        assert fsdp2["sharded_blocks"]
        assert fsdp2["grad_size"] > 1e3 * FSDP_GRADIENT_BOUND and fsdp2["grad_difference"] <= FSDP_GRADIENT_BOUND
        assert fsdp2["loss_difference"] <= FSDP_GRADIENT_BOUND
        assert fsdp2["shared_flags"] == ([0.0] if release_reason else [1.0]), "the loss forward packed"
        if release_reason is None:  # on TRL 1.14+ TRL's row shuffle splits the groups, as it does without sharing
            assert RANKS_PHRASE in fsdp2["plan_description"] and fsdp2["group_sizes"] == [GENERATIONS]
        # the agreement: a rank's own reason sends every rank to the plain path, so do unequal chunk counts, and a
        # first-batch check that fails on one rank fails on all
        assert fsdp2["agreed_one_plain"] == ("another rank runs this call's plain forward (a sharded model's "
                                             "forwards pair across the ranks)" if record["rank"] == 0
                                             else "this rank's reason")  # fmt: skip
        assert fsdp2["agreed_chunks"].startswith("the ranks would pack this call in 1 to 2 chunks")
        assert fsdp2["agreed_check"] is False


@pytest.mark.model
def test_several_processes_pack_unless_a_rank_cannot_hold_whole_groups(tiny_vlm_path, tmp_path):
    model, _ = load_vlm(str(tiny_vlm_path))
    release_reason = trl_seams.packed_path_reason()
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, num_generations=GENERATIONS,
                  per_device_train_batch_size=GENERATIONS)  # fmt: skip
    assert prefix_sharing.unsupported_reason(model, 2, PAPOGConfig(**common)) == release_reason
    split = PAPOGConfig(**common, accelerator_config={"split_batches": True})
    assert prefix_sharing.unsupported_reason(model, 1, split) == release_reason, "one process: nothing is split"
    reason = prefix_sharing.unsupported_reason(model, 2, split)
    assert (release_reason or "accelerator_config.split_batches=True with 2 processes") in reason
