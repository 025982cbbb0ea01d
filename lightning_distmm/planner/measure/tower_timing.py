"""Timing a live tower on this process's device: the measured profile of ``plan="auto"``.

:func:`measure_tower` times the real module's forward and backward at a few microbatch sizes and
fits ``t(b) = a + c * b``; activation bytes are counted from the tensors autograd saves, so they do
not depend on allocator caching; the AdamW step is timed on copies of the parameters. The result,
a :class:`MeasuredFit`, becomes a profile with :func:`lightning_distmm.planner.profiles.profile.measured_profile`.
torch is imported inside the functions: the planner stays importable without it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lightning_distmm.planner.profiles.profile import MeasuredFit


def _affine(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + c x`` with ``a, c >= 0`` (a single point gives ``a = 0``)."""
    n = len(xs)
    if n == 1:
        return 0.0, max(ys[0] / xs[0], 0.0)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    c = max(c, 0.0)
    a = my - c * mx
    if a < 0:  # force through the origin
        a, c = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return a, c


#: a size is timed over at least this many seconds of passes (and ``repeats`` passes), at most
#: MAX_PASSES passes: enough passes of a tiny tower that one preemption cannot set its time
MIN_TIMED_SECONDS = 0.05
MAX_PASSES = 50

#: the AdamW step is timed on copies (weights, gradients and two moments: 4x the trainable bytes)
#: only up to this size; larger towers keep the cost model's bandwidth estimate of the step
ADAMW_TIMING_BYTES = 2**30


def measure_tower(
    module: Any,
    make_inputs: Callable[[int], Sequence[Any]],
    batch_sizes: Sequence[int] = (1, 2, 4),
    device: Any = "cpu",
    frozen: bool = False,
    repeats: int = 2,
    warmup: int = 1,
    autocast: Callable[[], Any] | None = None,
) -> MeasuredFit:
    """Time ``module(*make_inputs(b))`` forward and backward at each ``b`` and fit ``a + c * b``.

    One process, no process group. Activation bytes per microbatch are the bytes of the tensors
    autograd saves for backward (distinct storages), so they do not depend on allocator caching.
    Backward runs on ``output.float().pow(2).mean()``, a stand-in for the loss. A frozen tower is
    timed forward only, under ``no_grad``. Cheap: a few forward/backward passes of a small model.

    ``autocast``: a context manager factory the forward runs in, the run's precision (Lightning's
    ``precision_plugin.forward_context``: ``bf16-mixed`` autocasts), so the tower is timed and its
    saved activations counted as the run computes them. The module moves to ``device`` for the
    measurement and back to where its first parameter was afterwards: towers are measured one at a
    time, and only one is ever on the device.
    """
    import contextlib

    import torch

    dev = torch.device(device)
    home = next((p.device for p in module.parameters()), dev)
    forward_context = autocast or contextlib.nullcontext
    module = module.to(dev)
    was_training = module.training
    module.train()
    params = sum(p.numel() for p in module.parameters())
    trainable = 0 if frozen else sum(p.numel() for p in module.parameters() if p.requires_grad)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    raw: list[dict[str, float]] = []
    opt_time: float | None = None
    try:
        for b in batch_sizes:
            inputs = [x.to(dev) if hasattr(x, "to") else x for x in make_inputs(int(b))]
            fwd_t, bwd_t, act = float("inf"), float("inf"), 0.0
            spent, i = 0.0, 0
            # the fastest of at least ``repeats`` passes and of MIN_TIMED_SECONDS of passes: a tiny
            # tower's pass takes microseconds, one preemption of a shared core milliseconds
            while i < warmup + repeats or (spent < MIN_TIMED_SECONDS and i < MAX_PASSES):
                module.zero_grad(set_to_none=True)
                seen: dict[int, int] = {}

                def pack(t: Any) -> Any:
                    try:
                        key = t.untyped_storage().data_ptr()
                        seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
                    except (RuntimeError, AttributeError):
                        pass
                    return t

                sync()
                t0 = time.perf_counter()
                if frozen:
                    with torch.no_grad(), forward_context():
                        out = module(*inputs)
                    sync()
                    t1 = t2 = time.perf_counter()
                else:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), forward_context():
                        out = module(*inputs)
                    out = first_tensor(out)
                    sync()
                    t1 = time.perf_counter()
                    out.float().pow(2).mean().backward()
                    sync()
                    t2 = time.perf_counter()
                if i >= warmup:
                    fwd_t, bwd_t = min(fwd_t, t1 - t0), min(bwd_t, t2 - t1)
                    act = float(sum(seen.values()))
                    spent += t2 - t0
                i += 1
            raw.append({"batch": float(b), "fwd": fwd_t, "bwd": bwd_t, "act_bytes": act})
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        if not frozen and trainable and 4 * nbytes <= ADAMW_TIMING_BYTES:
            opt_time = _time_adamw(module, repeats, sync)
    finally:
        module.zero_grad(set_to_none=True)
        module.train(was_training)
        if home != dev:
            module.to(home)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    xs = [r["batch"] for r in raw]
    return MeasuredFit(
        device=str(dev),
        batch_sizes=[int(x) for x in xs],
        fwd=_affine(xs, [r["fwd"] for r in raw]),
        bwd=_affine(xs, [r["bwd"] for r in raw]),
        act_bytes=_affine(xs, [r["act_bytes"] for r in raw]),
        params=params,
        trainable_params=trainable,
        raw=raw,
        opt_time=opt_time,
    )


def forward_backward_seconds(module: Any, inputs: Sequence[Any]) -> tuple[float, float]:
    """Seconds of one forward of ``module`` on ``inputs`` and of the backward of a scalar made from
    its first output (a DTensor's local part), gradients zeroed first."""
    module.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    out = first_tensor(module(*inputs))
    out = out.to_local() if hasattr(out, "to_local") else out
    t1 = time.perf_counter()
    out.float().pow(2).mean().backward()
    return t1 - t0, time.perf_counter() - t1


def measure_wrapped(
    module: Any,
    make_inputs: Callable[[int], Sequence[Any]],
    wrappers: Mapping[str, Callable[[Any], Any]],
    batch_sizes: Sequence[int] = (4, 16),
    repeats: int = 3,
) -> dict[str, tuple[tuple[float, float], tuple[float, float]]]:
    """What each wrapper adds to the tower's forward and backward on this device, as ``a + c * b``.

    ``wrappers[name](module)`` returns the module as the runtime runs it under one form, on a mesh of
    one rank (``"tp"``: tensor parallelism's DTensors; ``"fsdp"``: FSDP2's units): with no peer, what
    it adds to the plain module's seconds is the runtime's own work per layer (dispatch, hooks,
    copies), which FLOPs and bytes do not price. Each wrapper gets a deep copy; the plain module and
    the wrapped ones alternate per repeat, so that drift on a shared host hits them alike. The
    caller supplies the wrappers (the planner does not import the runtime) and a process group.
    """
    import copy

    variants = {"plain": module, **{name: wrap(copy.deepcopy(module)) for name, wrap in wrappers.items()}}
    best: dict[str, dict[int, list[float]]] = {k: {} for k in variants}
    for b in batch_sizes:
        inputs = list(make_inputs(int(b)))
        for i in range(1 + repeats):
            for name, m in variants.items():
                fwd, bwd = forward_backward_seconds(m, inputs)
                if i:  # the first pass warms up
                    got = best[name].setdefault(int(b), [float("inf"), float("inf")])
                    got[0], got[1] = min(got[0], fwd), min(got[1], bwd)
        del inputs
    module.zero_grad(set_to_none=True)
    xs = [float(b) for b in batch_sizes]
    out: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {}
    for name in wrappers:
        extra = [[max(best[name][int(b)][j] - best["plain"][int(b)][j], 0.0) for b in batch_sizes] for j in (0, 1)]
        out[name] = (_affine(xs, extra[0]), _affine(xs, extra[1]))
    return out


def _time_adamw(module: Any, repeats: int, sync: Callable[[], None]) -> float:
    """Seconds of one ``torch.optim.AdamW`` step (default implementation for the device) over copies
    of ``module``'s trainable parameters and their gradients: the module itself is not changed.
    AdamW because the cost model prices Adam's state and traffic (``CostOptions``); on CPU its cost
    is dominated by a dozen small ops per parameter tensor, which no bandwidth model sees."""
    import torch

    copies = []
    for p in module.parameters():
        if p.requires_grad:
            c = p.detach().clone().requires_grad_()
            c.grad = p.grad.detach().clone() if p.grad is not None else torch.zeros_like(c)
            copies.append(c)
    opt = torch.optim.AdamW(copies, lr=1e-6)
    opt.step()  # creates the moments
    best = float("inf")
    for _ in range(max(2, repeats)):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def first_tensor(out: Any) -> Any:
    import torch

    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        out = list(out.values())
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    for x in out:
        if isinstance(x, torch.Tensor):
            return x
    raise TypeError(f"tower output {type(out).__name__} holds no tensor to backpropagate")


__all__ = ["measure_tower", "measure_wrapped", "forward_backward_seconds", "first_tensor", "ADAMW_TIMING_BYTES"]
