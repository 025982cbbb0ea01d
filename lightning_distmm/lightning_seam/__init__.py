"""Every private Lightning (and torch) access of the distmm strategy, each behind one named function.

A distmm plan does what Lightning's strategies assume never happens: different ranks hold
different modules and load different rows. Where Lightning offers a public hook the package uses
it (``LightningModule.backward`` and ``configure_gradient_clipping`` through the mixin,
``ParallelStrategy.block_backward_sync``, ``Strategy.process_dataloader``,
``Strategy.on_train_batch_start``, ``Strategy.optimizer_step``); what is left is here, one
function per access, each saying what it reaches and why no public API does the job.
``tests/test_lightning_seam.py`` has one fast test per function that fails with a clear message
when a Lightning or torch upgrade moves or changes what it reaches; ``pyproject.toml`` pins
Lightning to the versions that test passes on.

One private torch access lives outside this module (``_StridedShard`` in ``parallel/``, which must
not import Lightning). The strategy overrides one private method, ``Strategy._configure_launcher``
(there is no public way to choose a launcher): its body is :func:`configure_launcher`, which
with the launcher it sets lives in :mod:`lightning_distmm.lightning_seam.launchers`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, IterableDataset

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ParallelStrategy

from lightning_distmm.lightning_seam.launchers import ConsolidatingLauncher as ConsolidatingLauncher
from lightning_distmm.lightning_seam.launchers import configure_launcher as configure_launcher


# ---------------------------------------------------------------------- process groups
def init_process_groups(strategy: ParallelStrategy) -> None:
    """Set up the default process group only: ``ModelParallelStrategy._setup_distributed``.

    ``ModelParallelStrategy.setup_environment`` (public) also builds its 2-D (dp, tp) DeviceMesh
    over all ranks, which a distmm plan does not use (each tower gets its own mesh in ``setup``,
    once the module's towers are known); its process-group half has no public name.
    """
    strategy._setup_distributed()  # type: ignore[attr-defined]


def default_store() -> Any:
    """The default group's key-value store (torch's ``_get_default_store``: no public getter), where
    failure records cross hosts."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


# ---------------------------------------------------------------------- the step
def zeroes_gradients_after_training_step(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether Lightning zeroes the gradients after this batch's ``training_step`` (before its backward).

    Lightning's rule, from the private ``_AutomaticOptimization._make_zero_grad_fn``: under
    automatic optimization, on the first batch of each accumulation window. Lightning calls the
    public ``optimizer_zero_grad`` hook only at that point, after ``training_step``; the runtime
    needs to know when the step starts (it frees the old gradients and posts the sums during the
    step's own backward).
    """
    module = trainer.lightning_module
    return bool(module.automatic_optimization and batch_idx % trainer.accumulate_grad_batches == 0)


def batches_processed(trainer: pl.Trainer | None) -> int:
    """Training batches this fit has processed (the distmm loader's position for a resume): Lightning's
    ``fit_loop.epoch_loop.batch_progress``, which has no public accessor."""
    if trainer is None:
        return 0
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def launcher_kill(strategy: ParallelStrategy) -> Callable[..., object] | None:
    """The strategy's launcher's ``kill`` (it passes a signal on to the ranks it started), if it has
    one: Lightning keeps the launcher in the private ``Strategy._launcher``."""
    return getattr(getattr(strategy, "_launcher", None), "kill", None)


def move_held_tensors(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s parameters and buffers to ``device``, leaving those on the meta device there.

    ``Module.to`` would try to copy the released (meta) towers and fail; torch's private
    ``Module._apply`` is what ``to`` itself uses to swap each tensor in place.
    """
    module._apply(lambda t: t if t.is_meta else t.to(device))


def optimizers_to_device(optimizers: Iterable[Optimizer], device: torch.device) -> None:
    """Move the optimizers' state to ``device``: Lightning's private ``_optimizers_to_device``, as
    ``ModelParallelStrategy.setup`` does (the distmm ``setup`` replaces that method)."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def evaluate_without_inference_mode(trainer: pl.Trainer) -> None:
    """Run the trainer's ``validate`` / ``test`` / ``predict`` loops under ``torch.no_grad`` instead of
    ``torch.inference_mode``: what ``Trainer(inference_mode=False)`` sets, decided by the strategy.

    Off gloo (NCCL) Lightning runs these standalone loops under ``inference_mode`` (it skips it on
    gloo, and for its own FSDP1 strategy). A tower sharded with FSDP2 then allocates its all-gather
    buffers as inference tensors: its forward fails (``Inference tensors do not track version
    counter``) or a later training forward does (``Inplace update to inference tensor outside
    InferenceMode``). Each loop reads its ``inference_mode`` attribute when it runs (Lightning's
    ``_no_grad_context``); the attribute is public on private loop classes, and a strategy has no
    other way to choose the evaluation context. Fit-time validation already runs under ``no_grad``.
    """
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        loop.inference_mode = False


# ---------------------------------------------------------------------- data
def disable_distributed_sampler(trainer: pl.Trainer) -> None:
    """Keep Lightning from wrapping the loaders' samplers in a ``DistributedSampler``.

    The distmm loader picks each rank's rows itself and every rank must walk the same global
    batches; Lightning's ``DistributedSampler`` would also reshuffle an unshuffled training set.
    ``Trainer(use_distributed_sampler=False)`` is the user's switch; a strategy can only set the
    private ``trainer._accelerator_connector.use_distributed_sampler``.
    """
    trainer._accelerator_connector.use_distributed_sampler = False


def train_dataloader(trainer: pl.Trainer) -> object | None:
    """The training DataLoader the fit will use, before Lightning loads it (None if there is none).

    ``trainer.train_dataloader`` is only set after the strategy's ``setup``; the plan is chosen
    in ``setup`` (default and ``"auto"`` plans measure the towers on a sample). The loader given
    to ``fit`` or defined by the module or datamodule is behind the private
    ``trainer.fit_loop._data_source``. A user hook that fails here yields None (planning falls
    back to parameter counts; the fit itself calls the hook again and reports the error).
    """
    source = trainer.fit_loop._data_source
    if not source.is_defined():
        return None
    try:
        return source.dataloader()
    except Exception:  # noqa: BLE001 - the user's train_dataloader hook: reported by the fit itself
        return None


# ---------------------------------------------------------------------- helpers of the strategy over the accesses above
def _train_dataloader(trainer: pl.Trainer) -> DataLoader | None:
    """The training DataLoader the fit will use, before Lightning processes it (None if unavailable)."""
    loader = train_dataloader(trainer)
    return loader if isinstance(loader, DataLoader) else None


def train_batch_size(trainer: pl.Trainer) -> int | None:
    return getattr(getattr(_train_dataloader(trainer), "batch_sampler", None), "batch_size", None)


def example_batch(trainer: pl.Trainer) -> Mapping[str, Any] | None:
    """One collated sample of the training data, to count or time the towers (None if unavailable)."""
    loader = _train_dataloader(trainer)
    if loader is None:
        return None
    if isinstance(loader.dataset, IterableDataset):  # a stream: its example() if it has one (data.FieldStream)
        example = getattr(loader.dataset, "example", None)
        sample = example() if callable(example) else None
    else:
        sample = loader.dataset[0] if len(loader.dataset) else None  # type: ignore[arg-type]
    batch = loader.collate_fn([sample]) if sample is not None else None
    return batch if isinstance(batch, Mapping) else None


@contextmanager
def random_state_kept(device: torch.device) -> Generator[None, None, None]:
    """Restore Python's, NumPy's and torch's random states (CPU and ``device``) on exit."""
    import random

    import numpy as np

    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" and torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def before_observer_ends_job(say: Callable[[list[tuple[int, int | None]]], None]) -> bool:
    """Have ``say((child index + 1, return code) ...)`` run before Lightning's child-process observer
    (the subprocess launcher's thread in this process) kills every process, this one included, with
    SIGKILL when a child ended badly; False when this process has no such observer.

    ``_ChildProcessObserver`` and its ``_terminate_all`` / ``_child_processes`` are private.
    """
    import threading

    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver) and not getattr(thread, "_distmm_last_words", False):
            original = thread._terminate_all

            def terminate_all(observer: Any = thread, end: Callable[[], None] = original) -> None:
                try:
                    say([(i + 1, p.returncode) for i, p in enumerate(observer._child_processes)])
                finally:
                    end()

            thread._terminate_all = terminate_all  # type: ignore[method-assign]
            thread._distmm_last_words = True  # type: ignore[attr-defined]
            return True
    return False
