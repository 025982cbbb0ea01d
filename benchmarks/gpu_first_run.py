"""The first run on a GPU: every path that has not met CUDA or NCCL yet, one check per process.

    python benchmarks/gpu_first_run.py --out benchmarks/results/h200_first_run.json   # one GPU, < 7 min
    python benchmarks/gpu_first_run.py --cpu-smoke --out /tmp/first_run.json           # CPU, gloo (the suite)

Each check runs in a process of its own, forked from this one (which imports the libraries once
and never touches the device), and prints PASS or FAIL with what it measured; a summary line and
a JSON with every check's figures follow. On one GPU every mesh has one rank (NCCL communicators
of size 1: the tower groups, the batch-sync group, the asynchronous gather). What needs two or
more GPUs is listed in docs/runtime.md ("The first GPU run"). On the GPU the time left after the
checks goes to ``benchmarks/gpu_calibrate.py``.

Checks (models of a few hundred thousand parameters, SGD or AdamW, a global batch of 8):

* ``mesh_async_gather``: a one-rank plan with the image tower sharded (FSDP2 over a one-rank
  mesh), two sync groups and the asynchronous batch-sync; the steps run and the loss is finite.
* ``bf16_clip``: colocated, ``bf16-mixed``, clipping by norm; the gradients are fp32, the memory is
  flat over steps, and the host syncs per step are counted (``torch.cuda.set_sync_debug_mode``).
* ``fp32_equivalence``: distmm's parameters after 3 steps equal a plain one-device Trainer's.
* ``async_vs_blocking``: the asynchronous batch-sync trains what the blocking one does, bit for bit.
* ``sharded_eval``: a sharded tower through ``validate``, ``fit``, ``validate`` and ``fit`` again
  under Lightning's default ``inference_mode`` (forced on the CPU: Lightning skips it on gloo), equal
  to a plain Trainer's sequence.
* ``deferred_init``: a module built on meta (``trainer.init_module(empty_init=True)``) and
  materialised on the device equals an ordinary seeded build.
* ``checkpoint``: 2 steps, a sharded checkpoint, 2 more resumed equal 4 straight steps;
  ``consolidated_state_dict`` equals the module's weights.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from synthetic import SyntheticPairs, TwoTowerCLIP  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_distmm as ldm  # noqa: E402
from lightning_distmm.models import Throughput  # noqa: E402
from lightning_distmm.models.tiny import TinyText, quiet_trainer_kwargs, tiny_vit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ, EMBED, BATCH = 64, 8, 16, 8


# ---------------------------------------------------------------------- the model and the data
class FirstRunCLIP(TwoTowerCLIP):
    """A timm ViT (2 blocks) and the text tower above: ~70k parameters.

    ``foreach``: the optimizers' multi-tensor kernels. None (torch's default) picks them on CUDA
    only; ``--cpu-smoke`` sets True so that the CPU run takes the path CUDA takes by default."""

    foreach: bool | None = None

    def __init__(self, optimizer: str = "sgd", lr: float = 0.05, groups: int = 1) -> None:
        super().__init__()
        self.optimizer_name, self.lr, self.sync_groups = optimizer, lr, groups
        self.visual = tiny_vit(16, 8, width=32, depth=2, heads=2, embed=EMBED)
        self.text = TinyText(VOCAB, SEQ, width=32, embed=EMBED, layers=2)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(params, lr=self.lr, foreach=self.foreach)
        return torch.optim.SGD(params, lr=self.lr, momentum=0.9, foreach=self.foreach)


def data(size: int = 64) -> DataLoader:
    return DataLoader(SyntheticPairs(size, 16, VOCAB, SEQ), batch_size=BATCH, drop_last=True)


@dataclass
class Context:
    """Where a check runs: ``device`` ("cuda" or "cpu"), ``folder`` for its files."""

    device: str
    folder: Path

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


def trainer(ctx: Context, steps: int, plan: Any = None, **extra: Any) -> L.Trainer:
    """One device; distmm with ``plan`` (the script launcher: this process is the only rank), or
    Lightning's plain single-device strategy when ``plan`` is None."""
    kw = quiet_trainer_kwargs(accelerator=ctx.device, devices=1, max_steps=steps)
    if plan is not None:
        kw["strategy"] = plan if isinstance(plan, ldm.DistMMStrategy) else ldm.DistMMStrategy(plan)
    kw.update(extra)
    return L.Trainer(**kw)


def one_rank(image: dict | None = None, text: dict | None = None, schedule: str = "gpipe") -> ldm.Plan:
    return ldm.Plan(
        1,
        {
            "image": {"ranks": [0], "schedule": schedule, **(image or {})},
            "text": {"ranks": [0], "schedule": schedule, **(text or {})},
        },
    )


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((_full(a[k]) - _full(b[k])).abs().max().item() for k in a)


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return (full() if callable(full) else t).detach().float().cpu().clone()


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: _full(v) for k, v in module.state_dict().items()}


class Losses(L.Callback):
    def __init__(self) -> None:
        self.values: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.values.append(float(trainer.callback_metrics["train/loss"]))


# ---------------------------------------------------------------------- the checks
def check_mesh_async_gather(ctx: Context) -> dict[str, Any]:
    plan = one_rank({"shard": "full", "microbatch": 2}, {"microbatch": 2}, schedule="distmm")
    L.seed_everything(0)
    losses = Losses()
    trainer(ctx, 2, ldm.DistMMStrategy(plan, overlap_batch_sync=True), callbacks=[losses]).fit(
        FirstRunCLIP(groups=2), data()
    )
    assert len(losses.values) == 2 and all(math.isfinite(v) for v in losses.values), losses.values
    return {"losses": losses.values}


class StepProbe(L.Callback):
    """Per step: the gradients' dtypes, the memory after the step, the host syncs during it."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.dtypes: set[str] = set()
        self.memory: list[int] = []
        self.syncs: list[int] = []
        self.sync_sites: list[list[str]] = []  # per step: the Python line each host sync came from
        self._caught: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.cuda:
            self._caught = warnings.catch_warnings(record=True)
            self._log = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Any) -> None:
        self.dtypes |= {str(p.grad.dtype) for p in pl_module.parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)
            caught = [w for w in self._log if "synchroniz" in str(w.message)]
            self.syncs.append(len(caught))
            self.sync_sites.append([f"{Path(w.filename).name}:{w.lineno}" for w in caught])
            self._caught.__exit__(None, None, None)
            torch.cuda.synchronize()
            self.memory.append(torch.cuda.memory_allocated())
        else:
            import resource

            self.memory.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def check_bf16_clip(ctx: Context) -> dict[str, Any]:
    L.seed_everything(0)
    probe = StepProbe(ctx.cuda)
    # the probe first: its count of host syncs ends before Throughput reads the step's timing events
    throughput = Throughput(window=1)
    steps = 6
    trainer(
        ctx,
        steps,
        "colocated",
        precision="bf16-mixed",
        gradient_clip_val=0.5,
        callbacks=[probe, throughput, TowerTimes()],
        log_every_n_steps=1,
    ).fit(FirstRunCLIP(), data())
    assert probe.dtypes == {"torch.float32"}, probe.dtypes
    times = TowerTimes.last
    assert times and all(math.isfinite(v) and v > 0 for v in times.values()), times
    settled = probe.memory[2:]
    growth = max(settled) - min(settled)
    assert growth <= (1 << 20), f"memory grew by {growth} bytes over steps 3..{steps}: {probe.memory}"
    return {
        "grad_dtypes": sorted(probe.dtypes),
        "memory_bytes": probe.memory,
        "host_syncs_per_step": probe.syncs,
        "host_sync_sites_last_step": probe.sync_sites[-1] if probe.sync_sites else [],
        "tower_seconds_last_step": times,
    }


class TowerTimes(L.Callback):
    """Keeps the last step's per-tower seconds that ``Throughput`` logged (CUDA events on a GPU)."""

    last: dict[str, float] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        TowerTimes.last = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("train/time/")}


def _deterministic(ctx: Context) -> None:
    """The same kernels in both runs of a comparison: no TF32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def check_fp32_equivalence(ctx: Context) -> dict[str, Any]:
    _deterministic(ctx)
    L.seed_everything(0)
    reference = FirstRunCLIP()
    module = copy.deepcopy(reference)
    trainer(ctx, 3).fit(reference, data())
    plan = one_rank({"microbatch": 4}, {"microbatch": 2})
    trainer(ctx, 3, plan).fit(module, data())
    diff = max_diff(weights(reference), weights(module))
    assert diff <= 1e-5, f"max abs difference {diff:.3g} after 3 steps"
    return {"max_abs_diff": diff}


def check_async_vs_blocking(ctx: Context) -> dict[str, Any]:
    _deterministic(ctx)
    plan = one_rank({"microbatch": 2}, {"microbatch": 2}, schedule="distmm")
    L.seed_everything(0)
    overlapped = FirstRunCLIP("adamw", 0.01, groups=2)
    blocking = copy.deepcopy(overlapped)
    trainer(ctx, 2, ldm.DistMMStrategy(plan, overlap_batch_sync=True)).fit(overlapped, data())
    trainer(ctx, 2, plan).fit(blocking, data())
    diff = max_diff(weights(overlapped), weights(blocking))
    assert diff == 0.0, f"max abs difference {diff:.3g}: not bit-identical"
    return {"max_abs_diff": diff}


def look_like_nccl() -> None:
    """Lightning's loops skip ``inference_mode`` on gloo; make them see another backend (as on NCCL).
    ``tests/scripts/eval_modes.py`` forces the same."""
    import lightning.pytorch.loops.utilities as loop_utilities

    class NotGloo:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch.distributed, name)

        @staticmethod
        def get_backend(group: Any = None) -> str:
            return "nccl"

    loop_utilities.dist = NotGloo()  # type: ignore[attr-defined]


def check_sharded_eval(ctx: Context) -> dict[str, Any]:
    _deterministic(ctx)
    if not ctx.cuda:
        look_like_nccl()
    plan = one_rank({"shard": "full"}, {"shard": "full"})
    L.seed_everything(0)
    reference = FirstRunCLIP("adamw", 0.01)
    module = copy.deepcopy(reference)
    results = {}
    for name, m, p in (("reference", reference, None), ("distmm", module, plan)):
        first = trainer(ctx, 2, p, limit_val_batches=2)
        before = first.validate(m, data(16), verbose=False)[0]["val/loss"]
        first.fit(m, data())
        after = first.validate(m, data(16), verbose=False)[0]["val/loss"]
        trainer(ctx, 1, p).fit(m, data(32))
        results[name] = [before, after]
    diff = max_diff(weights(reference), weights(module))
    assert results["distmm"] == [float(v) for v in results["distmm"]]
    loss_diff = max(abs(a - b) for a, b in zip(results["reference"], results["distmm"]))
    assert loss_diff <= 1e-5 and diff <= 1e-5, f"validation losses {results}, weights differ by {diff:.3g}"
    return {"val_losses": results, "max_abs_diff": diff}


class Materialised(L.Callback):
    """The weights as the strategy materialised them, before any step."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.weights = weights(pl_module)
        self.devices = sorted({str(_local(p).device.type) for p in pl_module.parameters()})


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def check_deferred_init(ctx: Context) -> dict[str, Any]:
    L.seed_everything(0)
    ordinary = weights(FirstRunCLIP())
    probe = Materialised()
    run = trainer(ctx, 1, one_rank({"shard": "full"}), callbacks=[probe])
    L.seed_everything(0)
    with run.init_module(empty_init=True):
        module = FirstRunCLIP()
    run.fit(module, data())
    diff = max_diff(ordinary, probe.weights)
    assert diff == 0.0 and probe.devices == [ctx.device], f"differs by {diff:.3g}; on {probe.devices}"
    return {"max_abs_diff": diff, "devices": probe.devices}


def check_checkpoint(ctx: Context) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_distmm.checkpoint import consolidated_state_dict

    _deterministic(ctx)
    plan = one_rank({"shard": "full"}, {"microbatch": 4})
    L.seed_everything(0)
    straight = FirstRunCLIP("adamw", 0.01)
    half, resumed = copy.deepcopy(straight), copy.deepcopy(straight)
    trainer(ctx, 4, plan).fit(straight, data())
    saver = ModelCheckpoint(dirpath=ctx.folder / "ckpt", every_n_train_steps=2, save_top_k=-1)
    trainer(ctx, 2, plan, callbacks=[saver], enable_checkpointing=True).fit(half, data())
    again = trainer(ctx, 4, plan)
    again.fit(resumed, data(), ckpt_path=str(ctx.folder / "ckpt" / "epoch=0-step=2.ckpt"))
    diff = max_diff(weights(straight), weights(resumed))
    consolidated = consolidated_state_dict(again)
    assert consolidated is not None
    whole = max_diff(weights(resumed), {k: _full(v) for k, v in consolidated.items()})
    assert diff <= 1e-5 and whole == 0.0, f"resumed differs by {diff:.3g}; consolidated by {whole:.3g}"
    return {"resumed_max_abs_diff": diff, "consolidated_max_abs_diff": whole}


def check_zero2_mixed_kernels(ctx: Context) -> dict[str, Any]:
    """A ``zero2`` tower beside an unsharded one, AdamW with torch's default kernels (multi-tensor on
    CUDA): one param group holds DTensors and plain tensors; equal to a plain Trainer."""
    _deterministic(ctx)
    L.seed_everything(0)
    reference = FirstRunCLIP("adamw", 0.01)
    module = copy.deepcopy(reference)
    trainer(ctx, 3).fit(reference, data())
    trainer(ctx, 3, one_rank({"shard": "zero2"})).fit(module, data())
    diff = max_diff(weights(reference), weights(module))
    assert diff <= 1e-5, f"max abs difference {diff:.3g} after 3 steps"
    return {"max_abs_diff": diff}


#: AdamW's epsilon in ``llava``: 1e-8 turns a gradient of 1e-9 that two GEMM shapes round differently
#: into an update of the learning rate's size (the suite's LLaVA tests use 1e-6 too)
EPS = 1e-6


class TransformersLlava(L.LightningModule):
    """The reference for ``llava``: transformers' own forward and loss, AdamW as ``LlavaModule``'s."""

    def __init__(self, model: nn.Module, lr: float) -> None:
        super().__init__()
        self.model, self.lr = model, lr

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        fields = ("pixel_values", "input_ids", "attention_mask", "labels")
        return self.model(**{k: batch[k] for k in fields}).loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=EPS, weight_decay=0.0)


def check_llava(ctx: Context, pack_tokens: int | None = None) -> dict[str, Any]:
    """transformers' ``LlavaForConditionalGeneration`` as two towers under ``DistMMStrategy()`` with
    no plan (the VLM search on the live towers, timed on the device), the tower handoff
    and torch's default AdamW kernels: equal to the model's own forward and loss in a plain Trainer.
    ``pack_tokens``: the language model on packed rows (transformers' packed-sequence attention on
    the device) against the padded reference."""
    sys.path.insert(0, str(ROOT / "recipes"))
    from llava_shapes import ShapesConversations, build_llava, build_tokenizer

    from lightning_distmm.models.llava import LlavaModule, llava_state_dict

    _deterministic(ctx)
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    model = build_llava(tokenizer)
    rows = DataLoader(ShapesConversations("train", 4 * BATCH, tokenizer), batch_size=BATCH, drop_last=True)
    reference = TransformersLlava(copy.deepcopy(model), 1e-3)
    module = LlavaModule(copy.deepcopy(model), lr=1e-3, eps=EPS, pack_tokens=pack_tokens)
    trainer(ctx, 3).fit(reference, rows)
    trainer(ctx, 3, ldm.DistMMStrategy()).fit(module, rows)
    ours = {k: _full(v) for k, v in llava_state_dict(module.state_dict()).items()}
    diff = max_diff(weights(reference.model), ours)
    moved = max_diff(weights(reference.model), weights(model))
    assert moved > 1e-4 and diff <= 1e-5, f"max abs difference {diff:.3g} after 3 steps (trained by {moved:.3g})"
    return {"max_abs_diff": diff, "max_trained_change": moved}


def check_llava_packed(ctx: Context) -> dict[str, Any]:
    """``llava`` with the language model's rows packed into sequences of 120 tokens (two samples each)."""
    return check_llava(ctx, pack_tokens=120)


CHECKS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "mesh_async_gather": check_mesh_async_gather,
    "bf16_clip": check_bf16_clip,
    "fp32_equivalence": check_fp32_equivalence,
    "async_vs_blocking": check_async_vs_blocking,
    "sharded_eval": check_sharded_eval,
    "deferred_init": check_deferred_init,
    "checkpoint": check_checkpoint,
    "zero2_mixed_kernels": check_zero2_mixed_kernels,
    "llava": check_llava,
    "llava_packed": check_llava_packed,
}


# ---------------------------------------------------------------------- running them
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(name: str, ctx: Context, pipe: Any) -> None:
    """One check in a forked process: its own process group (one rank), its own device context."""
    os.environ["MASTER_PORT"] = str(_free_port())
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE"):
        os.environ.pop(key, None)
    ctx.folder.mkdir(parents=True, exist_ok=True)
    try:
        details = CHECKS[name](ctx)
        pipe.send({"status": "PASS", "details": details})
    except BaseException as err:  # noqa: BLE001 - reported to the parent as the check's failure
        pipe.send({"status": "FAIL", "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})
    finally:
        pipe.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip the interpreter's teardown of process groups and threads


def run_check(name: str, ctx: Context, timeout: float) -> dict[str, Any]:
    fork = mp.get_context("fork")
    receive, send = fork.Pipe(duplex=False)
    start = time.monotonic()
    proc = fork.Process(target=_child, args=(name, ctx, send))
    proc.start()
    send.close()
    result: dict[str, Any] = {"status": "FAIL", "error": "the check's process ended without a result"}
    if receive.poll(timeout):
        try:
            result = receive.recv()
        except EOFError:
            pass
    else:
        result = {"status": "FAIL", "error": f"no result in {timeout:.0f} s (a hang?)"}
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()
    result["seconds"] = round(time.monotonic() - start, 2)
    return result


def calibrate(out: Path, seconds: float) -> dict[str, Any]:
    """``benchmarks/gpu_calibrate.py`` with the time left (GPU only)."""
    target = out.with_name(out.stem + "_calibration.json")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_calibrate.py"), "--out", str(target)]
    cmd += ["--timeout-s", str(max(30.0, seconds - 30.0))]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    status = "PASS" if done.returncode == 0 else "FAIL"
    return {"status": status, "out": str(target), "tail": (done.stdout + done.stderr)[-2000:]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where the JSON goes (e.g. benchmarks/results/h200_first_run.json)")
    p.add_argument("--cpu-smoke", action="store_true", help="on the CPU with gloo: every check's code path")
    p.add_argument("--budget-s", type=float, default=400.0, help="the whole run's time (checks, then calibration)")
    p.add_argument("--check-timeout-s", type=float, default=120.0, help="one check's limit")
    p.add_argument("--only", nargs="*", default=None, help="run only these checks")
    p.add_argument("--skip-calibration", action="store_true", help="no gpu_calibrate.py after the checks")
    args = p.parse_args(argv)
    start = time.monotonic()
    cuda = not args.cpu_smoke
    FirstRunCLIP.foreach = None if cuda else True
    if cuda and os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        print("no GPU visible (CUDA_VISIBLE_DEVICES is empty): use --cpu-smoke", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ctx = Context("cuda" if cuda else "cpu", out.parent / (out.stem + "_files"))
    results: dict[str, Any] = {}
    for name in args.only or list(CHECKS):
        left = args.budget_s - (time.monotonic() - start)
        result = run_check(name, ctx, min(args.check_timeout_s, max(left, 10.0)))
        results[name] = result
        shown = result.get("details") if result["status"] == "PASS" else result.get("error")
        print(f"{result['status']} {name} ({result['seconds']:.1f} s): {json.dumps(shown)[:300]}", flush=True)
        if result["status"] == "FAIL" and "traceback" in result:
            print(result["traceback"][-1500:], file=sys.stderr)
    passed = sum(r["status"] == "PASS" for r in results.values())
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda and torch.cuda.is_available() else "cpu",
        "cpu_smoke": args.cpu_smoke,
        "torch": torch.__version__,
        "lightning": L.__version__,
        "checks": results,
    }
    left = args.budget_s - (time.monotonic() - start)
    if cuda and left > 60 and not args.skip_calibration:
        report["calibration"] = calibrate(out, left)
    seconds = time.monotonic() - start
    report["summary"] = f"gpu_first_run: {passed}/{len(results)} checks PASS on {report['device']} in {seconds:.0f} s"
    out.write_text(json.dumps(report, indent=2, default=str))
    print(report["summary"])
    print(f"wrote {out}")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
