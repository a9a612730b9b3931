"""Memory of one step per variant: torch allocation peaks, live full-vocabulary tensors, and peak RSS in subprocesses.

In process, torch's own CPU allocation events (profiler ``profile_memory``; exact tensor bytes, peak above the
pre-step level) plus a count of live full-vocabulary tensors (``VocabTensorTracker``); peak RSS in one fresh
subprocess per variant (Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` just before the step). Both are
described in ``benchmarks/README.md``. ``measure_work`` adds the noise-free FLOP and op counts; ``rss_peak`` is the
in-process RSS peak of a whole ``train()``, which the in-loop benchmark uses on the CPU.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from papo_nb.bench.harness import STEP_VARIANTS, BenchSetup, build_setup, extra_forward, make_variants


class VocabTensorTracker(torch.utils._python_dispatch.TorchDispatchMode):
    """Watches live floating tensors whose last dimension is the vocabulary (logits, log-softmax, probabilities,
    their gradients) after every op, forward and backward. Liveness is that of the storage (``StorageWeakRef``), so
    views and autograd's saved tensors count once, exactly while they are alive. Parameters (the lm_head weight's
    transpose) are not counted.

    Reports the peak of their total bytes; the peak number alive at once of *full* ones: at least ``full_rows``
    vocabulary rows (one per completion token of the batch), i.e. a whole batch of logits, a copy of it or its
    gradient, as opposed to TRL's 128-row chunks; and the peak number alive at once of *logits* proper: outputs of
    the lm_head's matmul (forward only: in backward the lm_head's matmuls output hidden-size tensors)."""

    LOGITS_OPS = ("aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.linear.default")

    def __init__(self, vocab_size: int, full_rows: int, exclude: set[int] = frozenset()):
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak = StorageWeakRef
        self.vocab_size, self.full_bytes, self.exclude = vocab_size, None, set(exclude)
        self.full_rows = full_rows
        self.live: dict[int, tuple[Any, int, bool]] = {}
        self.peak_bytes = 0
        self.peak_op = None
        self.peak_full = 0
        self.peak_full_op = None
        self.peak_logits = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key, (ref, _, _, _) in list(self.live.items()):  # prune first: a freed address may be reused below
            if ref.expired():
                del self.live[key]
        is_matmul = str(func) in self.LOGITS_OPS
        for t in torch.utils._pytree.tree_leaves(out):
            if (
                isinstance(t, torch.Tensor)
                and t.dim() >= 2
                and t.shape[-1] == self.vocab_size
                and t.is_floating_point()
            ):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live and key not in self.exclude:
                    rows = storage.nbytes() // (self.vocab_size * t.element_size())
                    self.live[key] = (self._weak(storage), storage.nbytes(), rows >= self.full_rows, is_matmul)
        total = sum(entry[1] for entry in self.live.values())
        full = sum(1 for entry in self.live.values() if entry[2])
        logits = sum(1 for entry in self.live.values() if entry[3])
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_op = total, str(func)
        if full > self.peak_full:
            self.peak_full, self.peak_full_op = full, str(func)
        self.peak_logits = max(self.peak_logits, logits)
        return out


def allocation_peak(run: Callable[[], Any]) -> dict[str, float]:
    """Peak of torch's CPU tensor bytes allocated during ``run`` above the level at its start, from the
    profiler's allocation events (each carries the allocator's running total)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and str(node.extra_fields.device.type) == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.total_allocated))
        stack.extend(node.children)
    if not events:
        return dict(peak_bytes=0.0, net_bytes=0.0, allocations=0)
    events.sort()
    base = events[0][2] - events[0][1]
    return dict(
        peak_bytes=float(max(e[2] for e in events) - base),
        net_bytes=float(events[-1][2] - base),
        allocations=sum(1 for e in events if e[1] > 0),
    )


def cuda_peak(run: Callable[[], Any]) -> dict[str, float]:
    """CUDA allocator peak during ``run``: ``peak_bytes`` above the level at its start (after emptying the cache) and
    ``total_bytes``, the peak itself."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return dict(peak_bytes=float(peak - base), total_bytes=float(peak))


def measure_memory(setup: BenchSetup, names=STEP_VARIANTS + ("papo_step_eta0", "extra_forward")) -> dict[str, Any]:
    """Per variant: torch allocation peak (profiler) and the live full-vocab tensors (dispatch tracker): the peak
    of their bytes in units of one (B, T, V) fp32 logits tensor, and the peak number of whole-batch ones at once."""
    vocab = setup.model.get_output_embeddings().weight.shape[0]
    batch = setup.batch
    rows = batch["completion_ids"].shape[0] * batch["completion_ids"].shape[1]
    logits_bytes = rows * vocab * 4
    exclude = {p.untyped_storage().data_ptr() for p in setup.model.parameters()}
    variants = make_variants(setup, names)
    out: dict[str, Any] = {"logits_tensor_bytes": logits_bytes, "completion_rows": rows, "vocab_size": vocab}
    for name, variant in variants.items():
        variant.prepare()
        gc.collect()
        alloc = allocation_peak(variant.run)
        variant.cleanup()
        variant.prepare()
        gc.collect()
        tracker = VocabTensorTracker(vocab, full_rows=rows, exclude=exclude)
        with tracker:
            variant.run()
        variant.cleanup()
        out[name] = dict(
            alloc_peak_mib=alloc["peak_bytes"] / 2**20,
            alloc_net_mib=alloc["net_bytes"] / 2**20,
            vocab_bytes_peak=tracker.peak_bytes,
            vocab_bytes_peak_logits_equiv=tracker.peak_bytes / logits_bytes,
            vocab_bytes_peak_at=tracker.peak_op,
            full_logits_alive_peak=tracker.peak_full,
            full_logits_alive_peak_at=tracker.peak_full_op,
            lm_head_logits_alive_peak=tracker.peak_logits,
        )
    return out


def measure_work(setup: BenchSetup, names=STEP_VARIANTS + ("extra_forward",)) -> dict[str, Any]:
    """Noise-free accounting of the work each variant does: matmul/convolution FLOPs as torch.profiler counts them
    (``with_flops``) and the number of aten ops. ``papo_extra_gflop`` = PAPO-G - GRPO - extra forward: 0 means
    PAPO-G's only extra matmul work is that one full forward; below 0, the shared prompt prefix does less."""
    from torch.profiler import ProfilerActivity, profile

    out: dict[str, Any] = {}
    for name, variant in make_variants(setup, names).items():
        variant.prepare()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
            variant.run()
        variant.cleanup()
        events = prof.key_averages()
        out[name] = dict(
            gflop=sum(e.flops for e in events) / 1e9,
            aten_ops=sum(e.count for e in events if e.key.startswith("aten::")),
        )
    if all(n in out for n in ("grpo_step", "papo_step", "extra_forward")):
        out["papo_extra_gflop"] = out["papo_step"]["gflop"] - out["grpo_step"]["gflop"] - out["extra_forward"]["gflop"]
        out["papo_extra_aten_ops"] = (
            out["papo_step"]["aten_ops"] - out["grpo_step"]["aten_ops"] - out["extra_forward"]["aten_ops"]
        )
    if all(n in out for n in ("grpo_step", "papo_step_grad", "extra_forward")):
        out["papo_grad_extra_gflop_over_floor"] = (
            out["papo_step_grad"]["gflop"] - out["grpo_step"]["gflop"] - out["extra_forward"]["gflop"]
        )
    return out


def status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(field_name)


def rss_high_water(run: Callable[[], Any]) -> tuple[int, int]:
    """This process's RSS at the start of ``run`` and its high-water mark during it, in KiB (Linux ``VmHWM``, reset
    through ``/proc/self/clear_refs`` just before)."""
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS
    before = status_kib("VmRSS")
    run()
    return before, status_kib("VmHWM")


def rss_worker(
    size: str,
    variant: str,
    family: str,
    seed: int,
    cache_dir: str | None,
    n_prompts: int,
    batch_file: str | None = None,
) -> dict[str, Any]:
    """Run in a fresh process: set up, reset the RSS high-water mark, run ``variant`` once, report."""
    torch.set_num_threads(1)
    batch = torch.load(batch_file, weights_only=True) if batch_file else None
    setup = build_setup(size, family=family, seed=seed, cache_dir=cache_dir, n_prompts=n_prompts, batch=batch)
    extra_forward(setup.trainers["grpo"], setup.model, setup.batch)  # one-time initialisation, common to every variant
    chosen = make_variants(setup, (variant,))[variant]
    chosen.prepare()
    gc.collect()
    rss_before, hwm = rss_high_water(chosen.run)
    return dict(
        variant=variant,
        size=size,
        rss_before_mib=rss_before / 1024,
        step_peak_rss_mib=hwm / 1024,
        step_rss_increase_mib=(hwm - rss_before) / 1024,
        process_max_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
GLIBC_ADAPTIVE_CEILING = 32 * 2**20  # the highest mmap threshold glibc's adaptive setting reaches on 64-bit


def startup_mmap_threshold() -> int:
    """The mmap threshold this process started with: ``MALLOC_MMAP_THRESHOLD_`` (glibc 2.36 honours 4 GiB there; a
    64 MiB tensor stays in the heap), capped at ``mallopt``'s ``int``, else the ceiling glibc's adaptive threshold
    reaches (setting one ends the adaptation, which cannot be restored)."""
    asked = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    return min(int(asked), 2**31 - 1) if asked.isdigit() else GLIBC_ADAPTIVE_CEILING


def rss_peak(run: Callable[[], Any]) -> dict[str, float]:
    """Peak resident memory during ``run`` above the level at its start, in this process (Linux with glibc).

    For the call, blocks of 128 KiB and more are mmap-ed and the heap is trimmed first, so that a freed tensor leaves
    RSS at once and the high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) follows live memory rather
    than what the allocator kept from earlier calls. Unlike ``allocation_peak`` it records no per-allocation events,
    so a long step costs nothing extra (the profiler's event list reached 24 GB at R 1024). Afterwards the threshold
    goes back to what the process started with (``startup_mmap_threshold``), so that timing after it is unchanged."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, 128 * 1024)
    gc.collect()
    libc.malloc_trim(0)
    try:
        before, peak = rss_high_water(run)
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, startup_mmap_threshold())
    return dict(peak_bytes=float(peak - before) * 1024, rss_before_bytes=float(before) * 1024)


# glibc settings the RSS workers run under: its defaults, and large blocks always mmap-ed (so freed tensors go back to
# the OS at once and RSS follows live memory instead of what the allocator keeps after a free).
MALLOC_MODES = {"glibc_default": {}, "mmap_threshold_128k": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def measure_rss(
    setup: BenchSetup, cache_dir: str | None, n_prompts: int, variants=("grpo_step", "papo_step", "papo_step_grad")
) -> dict[str, Any]:
    """Peak RSS increase of one step, one fresh process per variant and malloc mode, all on ``setup``'s batch."""
    if not Path("/proc/self/clear_refs").exists():
        return {"skipped": "no /proc/self/clear_refs (not Linux)"}
    batch_file = setup.work_dir / f"rss_batch_{setup.size}.pt"
    torch.save(setup.batch, batch_file)
    out: dict[str, Any] = {}
    for variant in variants:
        out[variant] = {}
        for mode, malloc_env in MALLOC_MODES.items():
            cmd = [
                sys.executable,
                "-m",
                "papo_nb.bench.main",
                "--rss-worker",
                variant,
                "--rss-batch",
                str(batch_file),
                "--sizes",
                setup.size,
                "--family",
                setup.family,
                "--seed",
                str(setup.seed),
                "--n-prompts",
                str(n_prompts),
            ]
            cmd += ["--cache-dir", str(cache_dir)] if cache_dir else []
            done = subprocess.run(
                cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **malloc_env}
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("RSS_JSON ")]
            if done.returncode != 0 or not lines:
                out[variant][mode] = {"error": (done.stderr or done.stdout)[-2000:]}
            else:
                out[variant][mode] = json.loads(lines[-1][len("RSS_JSON ") :])
    return out
