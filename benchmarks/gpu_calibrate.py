"""Calibrate the cost model on one GPU: GEMM efficiency by size, two tower training steps, NCCL floor.

    timeout 540 python benchmarks/gpu_calibrate.py --timeout-s 420 --out benchmarks/results/h200_calibration.json
    python benchmarks/gpu_calibrate.py --cpu-smoke --out /tmp/smoke.json      # tiny, fp32, gloo (the test)

Why: the planner prices every GEMM as a roofline whose efficiency comes from a datasheet peak and a
published best-shape matmul efficiency applied to every size class (docs/planner.md, "Cluster"). This script measures what one device really
sustains, so that :func:`lightning_distmm.planner.machine.calibration.cluster_from_calibration` (preset
``cluster=h200_measured``) can price plans with measured numbers instead. It writes one JSON:

* ``gemm``: bf16 ``torch.mm`` over a grid of (M, N, K) typical of ViT-B/L/H and CLIP text towers
  (the four GEMMs of a transformer layer, forward, and the weight-gradient GEMM of the MLP, at
  M = tokens of a microbatch), plus square sizes: seconds, achieved TFLOP/s, fraction of peak.
* ``models``: timm ViT-B/16 and ViT-L/14 (from their configs, ``pretrained=False``: nothing is
  downloaded) and one transformers CLIP text tower (``CLIPTextConfig()``: the ViT-B/32 CLIP text
  encoder) timed forward and backward under bf16 autocast at several microbatch sizes: seconds,
  peak memory, FLOPs (``torch.utils.flop_counter``, forward + backward), MFU against the datasheet
  peak, and beside them the planner's analytic prediction for the same tower and microbatch on the
  device this run measured (``predicted_seconds``, ``predicted_memory_gb`` and the ratios measured /
  predicted: the cost model's error on this GPU, :func:`predict_towers`).
* ``nccl``: the process-group init at world size 1 and all-reduce times at a few sizes. With one
  rank NCCL moves nothing between devices: these are the per-call latency floor, recorded as such.

``--cpu-smoke`` runs the same code paths with tiny sizes, fp32 and gloo, so that the suite
(``tests/test_gpu_calibrate.py``) keeps it from rotting until a GPU is lent. ``--timeout-s`` stops
before the limit: every measurement checks the time left, skips what does not fit (listed under
``skipped``), and the JSON is rewritten after each section (and on SIGTERM), so a run cut short
still leaves what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the planner, for the predictions

SCHEMA = "lightning_distmm.gpu_calibration/1"

# Dense BF16 tensor-core peaks (TFLOP/s), from NVIDIA's datasheets (the figures without sparsity):
# A100 SXM 312, H100 SXM 989, H200 SXM 989; the same constants as conf/cluster/*_8x8.yaml.
DATASHEET_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}

# Transformer widths (d_model, MLP width) of the towers the planner's presets use: CLIP text B/L/H
# (512, 768, 1024), ViT-B/16 (768), ViT-L/14 (1024), ViT-H/14 (1280), ViT-g/14 (1408, MLP 6144);
# open_clip model configs.
GPU_WIDTHS = [(512, 2048), (768, 3072), (1024, 4096), (1280, 5120), (1408, 6144)]
# Rows M = tokens of one microbatch: 4 x 77 text tokens ~ 256 up to 256 x 257 ViT-H/14 tokens ~ 64k.
GPU_ROWS = [256, 1024, 4096, 16384, 65536]
GPU_SQUARES = [512, 1024, 2048, 4096, 6144, 8192]
GPU_VIT_MB = [32, 64, 128, 256]
GPU_VIT_L_MB = [16, 32, 64]
GPU_TEXT_MB = [64, 128, 256, 512]
GPU_ALLREDUCE_BYTES = [4, 64 * 2**10, 2**20, 16 * 2**20, 256 * 2**20]

CPU_WIDTHS = [(32, 128), (64, 256)]
CPU_ROWS = [64, 256]
CPU_SQUARES = [64, 128]
CPU_VIT_MB = [2, 4]
CPU_VIT_L_MB = [2]
CPU_TEXT_MB = [2, 4]
CPU_ALLREDUCE_BYTES = [4, 2**16]


class Stop(Exception):
    """Raised by the SIGTERM handler: stop measuring, write what was measured."""


@dataclass
class Budget:
    """Wall-clock budget of the run: ``left()`` seconds remain before ``limit_s``."""

    limit_s: float
    start: float = field(default_factory=time.perf_counter)
    skipped: list[str] = field(default_factory=list)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.limit_s - self.elapsed()

    def allows(self, what: str, need_s: float) -> bool:
        """True when ``need_s`` more seconds fit; else ``what`` is recorded as skipped."""
        if self.left() >= need_s:
            return True
        self.skipped.append(what)
        return False


# ---------------------------------------------------------------------------------------- timing
def _sync(dev: Any) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_fn(fn: Callable[[], Any], dev: Any, min_s: float, max_reps: int = 200) -> float:
    """Seconds of one call of ``fn``, after two warm-up calls.

    On a GPU: calls are issued back to back, ``n`` per trial with ``n`` chosen so a trial lasts
    about ``min_s / 5``, timed by CUDA events; the median of 5 trials divided by ``n``. Kernel
    launches are asynchronous, as in a training step, so a small GEMM is not charged the host's
    launch-and-synchronise round trip. On a CPU: the best of single calls filling ``min_s`` (a
    shared host's other processes only ever make a call slower)."""
    import torch

    fn()
    fn()
    _sync(dev)
    if dev.type == "cuda":
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        one = max(time.perf_counter() - t0, 1e-6)
        n = max(1, min(max_reps, int(min_s / 5 / one)))
        trials = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            trials.append(start.elapsed_time(end) / 1e3 / n)
        return sorted(trials)[2]
    times: list[float] = []
    total = 0.0
    while total < min_s and len(times) < max_reps or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt)
        total += dt
    return min(times)


# ----------------------------------------------------------------------------------------- GEMMs
def gemm_grid(widths: list[tuple[int, int]], rows: list[int], squares: list[int]) -> list[tuple[str, int, int, int]]:
    """(label, M, N, K) for ``out[M, N] = a[M, K] @ b[K, N]``: a transformer layer's GEMMs per width
    (qkv, attention projection, MLP up, MLP down; the MLP's weight gradient, K = tokens), squares."""
    grid = []
    for d, f in widths:
        for m in rows:
            grid += [
                (f"d{d} qkv", m, 3 * d, d),
                (f"d{d} proj", m, d, d),
                (f"d{d} fc1", m, f, d),
                (f"d{d} fc2", m, d, f),
                (f"d{d} fc1.wgrad", d, f, m),
            ]
    return grid + [(f"square {s}", s, s, s) for s in squares]


def measure_gemms(
    grid: list[tuple[str, int, int, int]], dev: Any, dtype: Any, peak: float, budget: Budget, min_s: float
) -> list[dict[str, Any]]:
    import torch

    out = []
    for label, m, n, k in grid:
        if not budget.allows(f"gemm {label} {m}x{n}x{k}", 4 * min_s + 1.0):
            continue
        a = torch.randn(m, k, device=dev, dtype=dtype)
        b = torch.randn(k, n, device=dev, dtype=dtype)
        c = torch.empty(m, n, device=dev, dtype=dtype)
        t = time_fn(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), dev, min_s)
        flops = 2.0 * m * n * k
        out.append(
            {
                "label": label,
                "m": m,
                "n": n,
                "k": k,
                "flops": flops,
                "bytes": float((m * k + k * n + m * n) * a.element_size()),
                "seconds": t,
                "tflops": flops / t / 1e12,
                "fraction_of_peak": flops / t / peak,
            }
        )
        del a, b, c
    return out


def measure_copy_bandwidth(dev: Any, numel: int, min_s: float) -> float:
    """Bytes/s of a device-to-device copy (read + write), the roofline's memory term."""
    import torch

    x = torch.empty(numel, device=dev, dtype=torch.float32)
    y = torch.empty_like(x)
    t = time_fn(lambda: y.copy_(x), dev, min_s)
    return 2.0 * numel * 4 / t


# ---------------------------------------------------------------------------------------- towers
# the towers timed, as the planner's profiles describe them (conf/model tower entries): the
# analytic prediction of each is priced from this description
TOWER_CONFIGS = {
    "vit_b16": {"arch": "vit", "img_size": 224, "patch_size": 16, "width": 768, "layers": 12, "heads": 12},
    "vit_l14": {"arch": "vit", "img_size": 224, "patch_size": 14, "width": 1024, "layers": 24, "heads": 16},
    "vit_smoke": {"arch": "vit", "img_size": 32, "patch_size": 16, "width": 64, "layers": 2, "heads": 2},
    "vit_l_smoke": {"arch": "vit", "img_size": 28, "patch_size": 14, "width": 32, "layers": 2, "heads": 2},
    "clip_text_b32": {
        "arch": "clip_text",
        "vocab_size": 49408,
        "context_length": 77,
        "width": 512,
        "layers": 12,
        "heads": 8,
    },
    "clip_text_smoke": {
        "arch": "clip_text",
        "vocab_size": 1000,
        "context_length": 77,
        "width": 64,
        "layers": 2,
        "heads": 2,
        "mlp_ratio": 4.0,
    },
}


def _build_timm_vit(timm_name: str, name: str, over: dict[str, Any]) -> tuple[Any, Callable[[int], Any], str]:
    import timm

    model = timm.create_model(timm_name, pretrained=False, num_classes=0, **over)
    size = over.get("img_size", 224)

    def batch(mb: int) -> Any:
        import torch

        return (torch.randn(mb, 3, size, size),)

    return model, batch, name


def build_vit_l(smoke: bool) -> tuple[Any, Callable[[int], Any], str]:
    """timm ViT-L/14 (patch 14, width 1024, depth 24, 16 heads; no weights downloaded), or a
    2-layer 32-wide one for the smoke run."""
    over = {"img_size": 28, "embed_dim": 32, "depth": 2, "num_heads": 2} if smoke else {}
    return _build_timm_vit("vit_large_patch14_clip_224", "vit_l_smoke" if smoke else "vit_l14", over)


def build_vit(smoke: bool) -> tuple[Any, Callable[[int], Any], str]:
    """timm ViT-B/16 from its config (no weights downloaded), or a 2-layer 64-wide one for the smoke run."""
    import timm

    # timm's vit_base_patch16_224 (patch 16, width 768, depth 12, 12 heads); the smoke run overrides its size
    over = {"img_size": 32, "embed_dim": 64, "depth": 2, "num_heads": 2} if smoke else {}
    model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=0, **over)
    name = "vit_smoke" if smoke else "vit_b16"
    size = over.get("img_size", 224)

    def batch(mb: int) -> Any:
        import torch

        return (torch.randn(mb, 3, size, size),)

    return model, batch, name


def build_clip_text(smoke: bool) -> tuple[Any, Callable[[int], Any], str]:
    """transformers CLIP text tower: ``CLIPTextConfig()`` defaults are CLIP ViT-B/32's text encoder
    (width 512, 12 layers, 8 heads, 77 tokens); a 2-layer 64-wide one for the smoke run."""
    from transformers import CLIPTextConfig, CLIPTextModel

    if smoke:
        small = {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2}
        cfg = CLIPTextConfig(vocab_size=1000, bos_token_id=998, eos_token_id=999, **small)
        name = "clip_text_smoke"
    else:
        cfg = CLIPTextConfig()
        name = "clip_text_b32"
    model = CLIPTextModel(cfg)
    seq, vocab = cfg.max_position_embeddings, cfg.vocab_size

    def batch(mb: int) -> Any:
        import torch

        return (torch.randint(0, vocab, (mb, seq)),)

    return model, batch, name


def _features(model: Any, out: Any) -> Any:
    if hasattr(out, "pooler_output"):
        return out.pooler_output
    return out


def measure_tower(
    name: str,
    model: Any,
    make_batch: Callable[[int], Any],
    microbatches: list[int],
    dev: Any,
    autocast_dtype: Any,
    peak: float,
    budget: Budget,
    min_s: float,
    rows: list[dict[str, Any]],
) -> None:
    """Forward and backward of ``model`` per microbatch, appended to ``rows`` as measured (a run
    stopped part way keeps them): seconds, peak memory, FLOPs, MFU.

    FLOPs are counted once (``FlopCounterMode`` over a forward and backward of the smallest
    microbatch) and scaled linearly: every FLOP of these towers is per sample."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    model = model.to(dev).train()
    cuda = dev.type == "cuda"

    def step(inputs: tuple[Any, ...]) -> None:
        with torch.autocast(dev.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            feats = _features(model, model(*inputs))
        feats.float().square().mean().backward()
        model.zero_grad(set_to_none=True)

    first = tuple(x.to(dev) for x in make_batch(microbatches[0]))
    counter = FlopCounterMode(display=False)
    with counter:
        step(first)
    flops_per_sample = counter.get_total_flops() / microbatches[0]
    for mb in microbatches:
        if not budget.allows(f"{name} microbatch {mb}", 10 * min_s + 5.0):
            continue
        row: dict[str, Any] = {"model": name, "microbatch": mb}
        try:
            inputs = tuple(x.to(dev) for x in make_batch(mb))
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(dev)
            resident = torch.cuda.memory_allocated(dev) if cuda else 0
            t = time_fn(lambda inputs=inputs: step(inputs), dev, min_s, max_reps=30)
            flops = flops_per_sample * mb
            row.update(
                {
                    "seconds": t,
                    "samples_per_s": mb / t,
                    "flops": flops,
                    "tflops": flops / t / 1e12,
                    "mfu": flops / t / peak,
                    # everything allocated at the peak (weights included), and the weights and inputs alone
                    "peak_memory_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if cuda else None,
                    "resident_memory_gb": resident / 1e9 if cuda else None,
                }
            )
            del inputs
        except torch.cuda.OutOfMemoryError:
            row["oom"] = True
            rows.append(row)
            break
        rows.append(row)
    model.to("cpu")


# ------------------------------------------------------------------------------------------ NCCL
def measure_collectives(backend: str, dev: Any, sizes: list[int], budget: Budget, min_s: float) -> dict[str, Any]:
    """Process-group init and all-reduce at world size 1: per-call latency floor, no link crossed."""
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res: dict[str, Any] = {
        "backend": backend,
        "world_size": 1,
        "note": "one rank: no data crosses a link; init cost and the per-call latency floor only",
    }
    t0 = time.perf_counter()
    kw: dict[str, Any] = {"device_id": dev} if backend == "nccl" else {}
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=max(30.0, min(120.0, budget.left()))),
        **kw,
    )
    try:
        x = torch.ones(1, device=dev)
        dist.all_reduce(x)  # NCCL builds its communicator lazily on the first collective
        _sync(dev)
        res["init_seconds"] = time.perf_counter() - t0
        res["allreduce"] = []
        for nbytes in sizes:
            if not budget.allows(f"{backend} all_reduce {nbytes} B", 4 * min_s + 1.0):
                continue
            x = torch.ones(max(1, nbytes // 4), device=dev)
            t = time_fn(lambda x=x: dist.all_reduce(x), dev, min_s)
            res["allreduce"].append({"bytes": nbytes, "seconds": t})
            del x
    finally:
        dist.destroy_process_group()
    return res


# ----------------------------------------------------------------------------------------- driver
def device_info(dev: Any, smoke: bool, peak_override: float | None) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"type": dev.type}
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        info.update(
            {
                "name": props.name,
                "memory_gb": props.total_memory / 1e9,
                "sm_count": props.multi_processor_count,
                "compute_capability": f"{props.major}.{props.minor}",
                "dtype": "bfloat16",
            }
        )
        key = next((k for k in DATASHEET_PEAK_TFLOPS if k in props.name), None)
        if peak_override:
            info.update(peak_tflops=peak_override, peak_source="--peak-tflops")
        elif key:
            info.update(peak_tflops=DATASHEET_PEAK_TFLOPS[key], peak_source=f"NVIDIA {key} datasheet, BF16 dense")
        else:
            info.update(peak_tflops=None, peak_source="best measured GEMM (no datasheet figure for this device)")
    else:
        try:
            import psutil

            mem = psutil.virtual_memory().total / 1e9
        except ImportError:  # pragma: no cover
            mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        info.update(
            {
                "name": f"cpu/{torch.get_num_threads()}t ({platform.processor() or platform.machine()})",
                "memory_gb": mem,
                "sm_count": None,
                "dtype": "float32",
                "peak_tflops": peak_override,
                "peak_source": "--peak-tflops" if peak_override else "best measured GEMM (CPU: no datasheet peak)",
            }
        )
    return info


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure everything the budget allows; the result is written to ``args.out`` as it grows."""
    import torch

    budget = Budget(args.timeout_s)
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        raise SystemExit("no CUDA device: run with --cpu-smoke for the tiny CPU version")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    smoke = not cuda
    torch.manual_seed(0)
    if smoke:
        torch.set_num_threads(1)  # tiny sizes: one thread is faster, and spares a shared test host
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "kind": "cuda" if cuda else "cpu-smoke",
        "note": "measured on one GPU" if cuda else "CPU smoke run: tiny sizes, fp32, gloo; NOT GPU numbers",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "device": device_info(dev, smoke, args.peak_tflops),
        "gemm": [],
        "models": [],
        "nccl": None,
        "errors": [],
    }
    if cuda:
        result["versions"]["cuda"] = torch.version.cuda
        with contextlib.suppress(Exception):  # an int on old releases, a tuple on recent ones
            v = torch.cuda.nccl.version()
            result["versions"]["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    out = Path(args.out)

    def save(final: bool = False) -> None:
        result["budget"] = {
            "limit_s": budget.limit_s,
            "elapsed_s": budget.elapsed(),
            "skipped": list(budget.skipped),
            "complete": final and not budget.skipped and not result["errors"],
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)

    # the peak the fractions are taken of: the datasheet's, else (CPU) the best GEMM measured
    peak = (result["device"]["peak_tflops"] or 0.0) * 1e12

    @contextlib.contextmanager
    def section(name: str) -> Iterator[None]:
        try:
            yield
        except Stop:
            raise
        except Exception as exc:  # a failed section is recorded; the others still run
            result["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        save()

    try:
        measure_all(result, smoke, cuda, dev, budget, peak, section)
    except Stop as stop:
        result["errors"].append(f"stopped by {stop}")
        save()
        raise
    save(final=True)
    return result


def measure_all(
    result: dict[str, Any], smoke: bool, cuda: bool, dev: Any, budget: Budget, peak: float, section: Any
) -> None:
    """The three sections in order of value to the cost model: GEMMs, collectives, towers."""
    import torch

    min_s = 0.02 if smoke else 0.1
    dtype = torch.bfloat16 if cuda else torch.float32
    with section("gemm"):
        grid = gemm_grid(*(CPU_WIDTHS, CPU_ROWS, CPU_SQUARES) if smoke else (GPU_WIDTHS, GPU_ROWS, GPU_SQUARES))
        rows = measure_gemms(grid, dev, dtype, peak or 1.0, budget, min_s)
        if not peak and rows:
            peak = max(r["flops"] / r["seconds"] for r in rows)
            for r in rows:
                r["fraction_of_peak"] = r["flops"] / r["seconds"] / peak
            result["device"]["peak_tflops"] = peak / 1e12
        result["gemm"] = rows
        if budget.allows("copy bandwidth", 2.0):
            numel = 2**20 if smoke else 256 * 2**20
            result["device"]["memory_bandwidth_gbps"] = measure_copy_bandwidth(dev, numel, min_s) / 1e9
    with section("nccl"):
        if budget.allows("collectives", 15.0):
            backend = "nccl" if cuda else "gloo"
            sizes = GPU_ALLREDUCE_BYTES if cuda else CPU_ALLREDUCE_BYTES
            result["nccl"] = measure_collectives(backend, dev, sizes, budget, min_s)
    towers = (
        (build_vit, CPU_VIT_MB if smoke else GPU_VIT_MB),
        (build_clip_text, CPU_TEXT_MB if smoke else GPU_TEXT_MB),
        (build_vit_l, CPU_VIT_L_MB if smoke else GPU_VIT_L_MB),
    )
    for builder, mbs in towers:
        with section(builder.__name__):
            if budget.allows(builder.__name__, 20.0):
                model, make_batch, name = builder(smoke)
                autocast = dtype if cuda else None
                measure_tower(name, model, make_batch, mbs, dev, autocast, peak, budget, min_s, result["models"])
                del model
    with section("predictions"):
        predict_towers(result)


def predict_towers(result: dict[str, Any]) -> None:
    """Beside every measured tower step, the planner's analytic prediction of the same tower and
    microbatch (forward + backward, :func:`lightning_distmm.planner.cost.stage_compute`) on the
    device this run measured (:func:`lightning_distmm.planner.machine.calibration.device_from_calibration`:
    its GEMM efficiency per size class and copy bandwidth, the preset's attention efficiency), and
    its memory (fp32 weights and gradients, autocast's bf16 weight copies, the activations the
    profile keeps); ``time_ratio`` and ``memory_ratio`` are measured / predicted."""
    import dataclasses as dc

    from lightning_distmm.planner.cost import CostOptions, memory_per_device, stage_compute
    from lightning_distmm.planner.machine.calibration import SCHEMA as PLANNER_SCHEMA
    from lightning_distmm.planner.machine.calibration import device_from_calibration
    from lightning_distmm.planner.machine.cluster import Cluster, Link
    from lightning_distmm.planner.measure.local import load_cluster
    from lightning_distmm.planner.profiles.profile import tower_profile

    assert PLANNER_SCHEMA == SCHEMA, "the script and the planner's loader disagree on the schema"
    smoke = result["kind"] == "cpu-smoke"
    base = None if smoke else load_cluster(_preset_for(result["device"]["name"])).device
    data = {**result, "budget": {}}
    device = device_from_calibration(data, base)
    if smoke:
        device = dc.replace(device, attention_efficiency=None)  # CPUs: attention FLOPs priced as GEMMs
    cluster = Cluster("calibrated", 1, 1, device, Link(1e9, 0.0), Link(1e9, 0.0))
    opts = CostOptions(precision="fp32" if smoke else "bf16-mixed")
    for row in result["models"]:
        if row.get("oom") or row["model"] not in TOWER_CONFIGS:
            continue
        p = tower_profile(row["model"], TOWER_CONFIGS[row["model"]], 512)
        mb = row["microbatch"]
        f, b = (float(x) for x in stage_compute(p, cluster, opts, float(mb), 1, 1))
        # what torch holds at the backward's peak: fp32 weights and gradients, the bf16 copies
        # autocast caches, the kept activations (the profile's, per sample)
        static = p.params * (4 + 4 + (0 if smoke else 2))
        act = float(memory_per_device(p, opts, "gpipe", mb, 1, mb, 1, 1)["activations"])
        row["predicted_seconds"] = f + b
        row["time_ratio"] = row["seconds"] / (f + b)
        row["predicted_memory_gb"] = (static + act) / 1e9
        if row.get("peak_memory_gb"):
            row["memory_ratio"] = row["peak_memory_gb"] / row["predicted_memory_gb"]


def _preset_for(device_name: str) -> str:
    """The cluster preset of a GPU by its name (H200, H100, else A100)."""
    for key, preset in (("H200", "h200_8x8"), ("H100", "h100_8x8"), ("A100", "a100_8x8")):
        if key in device_name.upper():
            return preset
    return "h200_8x8"


def table(result: dict[str, Any]) -> str:
    """The short summary printed at the end."""
    d = result["device"]
    lines = [
        f"{result['kind']}: {d['name']}, peak {d['peak_tflops'] or float('nan'):.3g} TFLOP/s ({d['peak_source']}),"
        f" copy {d.get('memory_bandwidth_gbps', float('nan')):.4g} GB/s",
        "GEMM by size (FLOPs decade): count, best/median fraction of peak",
    ]
    classes: dict[int, list[float]] = {}
    for r in result["gemm"]:
        classes.setdefault(int(math.floor(math.log10(r["flops"]))), []).append(r["fraction_of_peak"])
    for c in sorted(classes):
        f = sorted(classes[c])
        lines.append(f"  1e{c:<3d} {len(f):3d}  {max(f):.3f} / {f[len(f) // 2]:.3f}")
    lines.append("tower step (fwd+bwd): microbatch, ms, TFLOP/s, MFU, peak GB; measured/predicted time, memory")
    for r in result["models"]:
        if r.get("oom"):
            lines.append(f"  {r['model']:16s} {r['microbatch']:5d}  OOM")
            continue
        mem = f"{r['peak_memory_gb']:.2f}" if r.get("peak_memory_gb") is not None else "-"
        tr = f"{r['time_ratio']:.2f}" if r.get("time_ratio") else "-"
        mr = f"{r['memory_ratio']:.2f}" if r.get("memory_ratio") else "-"
        lines.append(
            f"  {r['model']:16s} {r['microbatch']:5d} {r['seconds'] * 1e3:9.2f} {r['tflops']:8.3g}"
            f" {r['mfu']:6.3f} {mem:>6s}  {tr:>5s} {mr:>5s}"
        )
    n = result.get("nccl")
    if n:
        ar = ", ".join(f"{a['bytes']} B {a['seconds'] * 1e6:.1f} us" for a in n.get("allreduce", []))
        lines.append(f"{n['backend']} world 1: init {n.get('init_seconds', float('nan')):.2f} s; all_reduce {ar}")
    b = result["budget"]
    lines.append(
        f"{b['elapsed_s']:.1f} s of {b['limit_s']:.3g} s; skipped {len(b['skipped'])}; errors {len(result['errors'])}"
    )
    lines += [f"  error: {e}" for e in result["errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where the JSON goes (e.g. benchmarks/results/h200_calibration.json)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes, fp32, gloo: exercises every code path")
    p.add_argument("--timeout-s", type=float, default=420.0, help="stop measuring before this many seconds")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's peak (default: datasheet table)")
    args = p.parse_args(argv)

    def on_term(signum: int, frame: Any) -> None:
        raise Stop(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        result = run(args)
    except Stop:
        print(f"stopped by SIGTERM; partial results in {args.out}", file=sys.stderr)
        return 1
    print(table(result))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
