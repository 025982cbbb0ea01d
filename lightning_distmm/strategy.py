"""``DistMMStrategy``: the Lightning wiring of a distmm plan.

Hooks over reusable parts: :mod:`~lightning_distmm.plan_choice` says which plan runs,
:mod:`~lightning_distmm.parallel` builds its groups and owns the step (the module calls the
:class:`~lightning_distmm.parallel.step.engine.StepEngine` installed here), :mod:`~lightning_distmm.data`
loads each rank's share, :mod:`~lightning_distmm.checkpoint` saves and restores shards,
:mod:`~lightning_distmm.rank_failures` ends every rank with the first cause. Lightning's
``ModelParallelStrategy`` gives process groups, launchers, DCP saving and restore-after-setup;
private Lightning accesses go through :mod:`~lightning_distmm.lightning_seam`.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_distmm import checkpoint as ckpt
from lightning_distmm import elastic, faults
from lightning_distmm import lightning_seam as seam
from lightning_distmm.async_checkpoint import AsyncSaver
from lightning_distmm.core.plan import Plan
from lightning_distmm.core.schedule import overlaps_batch_sync
from lightning_distmm.data.loader.loading import RankLoaders
from lightning_distmm.drift_replan import DriftReplanner
from lightning_distmm.mixin import DistMMMixin
from lightning_distmm.parallel.deferred import deferred_init
from lightning_distmm.parallel.exit_settle import settle_collectives_at_exit
from lightning_distmm.parallel.groups import nodes_of_ranks
from lightning_distmm.parallel.host_allocator import keep_freed_host_memory
from lightning_distmm.parallel.optimizer_kernels import prepare_mixed_groups
from lightning_distmm.parallel.step.engine import StepEngine, start_engine
from lightning_distmm.plan_choice import PlanSpec, check_precision, parse_plan_spec, plan_of_run
from lightning_distmm.rank_failures import RankFailures, after_ranks_ended

#: how long a collective waits before it fails: a slow checkpoint write, not Lightning's half hour
DEFAULT_TIMEOUT = timedelta(minutes=10)
StartMethod = Literal["popen", "spawn", "fork"]
_log = logging.getLogger(__name__)


def _say(line: str) -> None:  # a function, not a lambda: spawn pickles the strategy with it
    rank_zero_info(f"distmm: {line}")


class DistMMStrategy(ModelParallelStrategy):
    """Train a :class:`~lightning_distmm.DistMMMixin` module with each tower on its own ranks.

    Args:
        plan: a :class:`Plan`, a path to a plan YAML, ``"default"``/``None`` (the cheaper, as the cost
            model prices them from counted FLOPs, operators and parameters, of ranks in proportion to
            each tower's forward FLOPs, every tower on every rank, and the other splits of the ranks;
            :mod:`lightning_distmm.planner.default`), ``"colocated"``
            (every rank holds every tower: the DDP-like baseline through the same code path), or
            ``"auto"`` (the planner, on tower profiles measured on this device).
        start_method: ``"popen"`` re-runs the script per rank (scripts, torchrun, SLURM);
            ``"spawn"``; ``"fork"`` (the notebook-safe one).
        bucket_cap_mb: gradients are summed over a tower's replicas in buckets of this size,
            posted during the backward as they become final (DDP's ``bucket_cap_mb``).
        timeout: how long a collective waits for its peers before failing (default 10 minutes).
        reuse_host_memory: on the CPU, fix glibc's mmap and trim thresholds in each rank's process so
            that the memory a step frees serves the next step instead of going back to the kernel
            and being faulted in again (:mod:`lightning_distmm.parallel.host_allocator`); ``False``
            leaves the allocator as it is.
        stream_check_every: over an iterable dataset, the ranks check that they read the same samples
            every this many global batches (and on each epoch's first, and at its end): one all-gather
            of three integers (:mod:`lightning_distmm.data.streams.agreement`). A dataset declared with
            :func:`lightning_distmm.data.rank_independent` is not checked.
        failure_grace: how long a rank waits, blocked, after another rank recorded an error (or one of
            its host died), before it ends itself with that rank's error (NCCL, unlike gloo, leaves it
            in the collective until the timeout; :class:`~lightning_distmm.faults.PeerFailureWatch`).
            ``None``: wait for the collective timeout.
        overlap_batch_sync: ``schedule: distmm`` only: split every batch-sync but the last into a
            posted gather and its wait, running the next sync group's forwards between them (one
            more microbatch's activations held per stage, one gather per step hidden;
            docs/pipeline.md, "Asynchronous batch-sync"). The same result either way.
        balance: ``"cost"`` (default): each step's rows go to a tower's replicas by what they cost,
            where the tower says (``Tower(cost=...)``); ``"rows"``: by count, as the plan splits them.
            A plan's own ``balance`` key, when set, decides instead.
        async_save: checkpoints saved during fit hold the step only for a copy of this rank's shards
            to CPU memory; a background thread writes them (:mod:`lightning_distmm.async_checkpoint`:
            one save in flight, ``meta.pt`` written last so that an unfinished save is never
            resumed from). ``strategy.wait_for_saves()`` waits for it; so do the end of fit and a load.
        replan: ``"drift"``: every ``replan_every`` steps compare the towers' measured times with the
            first window under the plan; past ``replan_margin`` (a fraction), price the plans on the
            measurements and switch, through a checkpoint, to one predicted faster by more than that
            (:mod:`lightning_distmm.drift_replan`; docs/planner.md, "Re-planning while the job runs"). ``None``: the plan stays.
    """

    strategy_name = "distmm"

    def __init__(
        self,
        plan: PlanSpec = None,
        start_method: StartMethod = "popen",
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        bucket_cap_mb: float = 25.0,
        reuse_host_memory: bool = True,
        stream_check_every: int = 1,
        failure_grace: timedelta | None = timedelta(seconds=30),
        balance: Literal["cost", "rows"] = "cost",
        overlap_batch_sync: bool = False,
        async_save: bool = False,
        replan: Literal["drift"] | None = None,
        replan_every: int = 50,
        replan_margin: float = 0.10,
    ) -> None:
        if replan not in (None, "drift"):
            raise ValueError(f"replan={replan!r}: choose 'drift' (re-plan when measured times drift) or None")
        if balance not in ("cost", "rows"):
            raise ValueError(
                f"balance={balance!r}: choose 'cost' (each step's rows to the replicas by their cost, where a"
                f" tower gives Tower(cost=...)) or 'rows' (by count, the plan's split)"
            )
        self._balance = balance
        self._overlap_batch_sync = bool(overlap_batch_sync)
        #: rank 0 notes each step it starts beside the checkpoints (elastic.ProgressNote): a resumed run
        #: says how many steps the run before it lost
        self._progress: elastic.ProgressNote | None = None
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        self._loaders = RankLoaders(self._batches_done, stream_check_every, note=_say)
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._reuse_host_memory = reuse_host_memory
        self._plan_spec = parse_plan_spec(plan)
        self._start_method = start_method
        self.plan: Plan | None = self._plan_spec if isinstance(self._plan_spec, Plan) else None
        #: this rank's step engine: what the module calls under distmm, holding the step in progress
        #: (made in ``setup``)
        self.engine: StepEngine | None = None
        #: each rank's first error, readable by every rank after any rank's death (docs/runtime.md)
        self.failures = RankFailures(failure_grace)
        self._saver = AsyncSaver() if async_save else None
        self._failed = False  # an exception ended this fit: its save in flight is not waited for
        self._replan = DriftReplanner(replan_every, replan_margin) if replan else None
        self._refitting = False  # the module was rebuilt for a re-plan: its values come from a checkpoint

    # ------------------------------------------------------------------ launch
    @override
    def _configure_launcher(self) -> None:
        # the first hook Lightning calls with the precision plugin in place, when the Trainer is built
        # (in the launching process and on every rank that builds it: all refuse alike)
        check_precision(self.precision_plugin)
        assert self.cluster_environment is not None
        if self._start_method != "popen" or not self.cluster_environment.creates_processes_externally:
            # this process starts the ranks (popen's rank 0, the spawn/fork parent): a fresh run id
            # and its pid, set before any rank starts, so that every rank inherits them
            faults.note_launcher()
        faults.ensure_run_id()
        seam.configure_launcher(
            self, self._start_method, self._consolidated_state_dict, after_ranks_ended, self._release_engine
        )

    def _release_engine(self) -> None:
        """On a spawn/fork rank whose work is done (the whole model handed to the parent): drop the
        engine, whose per-tower meshes hold the towers' process groups, so that they end when the
        launcher destroys the default group rather than at the interpreter's exit."""
        self.engine = None

    def _consolidated_state_dict(self) -> dict[str, Tensor] | None:
        return ckpt.consolidated_state_dict(self) if self.engine is not None else None

    @override
    def setup_environment(self) -> None:
        # failure handling first: joining the process group is the first thing that can hang
        assert self.cluster_environment is not None
        started_by_launcher = self._start_method != "popen" or self.cluster_environment.creates_processes_externally
        self.failures.start(self.global_rank, self.world_size, started_by_launcher)
        # process groups only: the per-tower meshes need the module's towers, made in ``setup``.
        # Lightning re-seeds every generator from PL_GLOBAL_SEED there (reset_seed); the RNG state
        # the user's script reached (model built, same on every rank) is kept instead, so that an
        # unseeded sampler, dropout and the like draw what an ordinary single-process run draws
        with self.failures.joining(started_by_launcher), seam.random_state_kept(self.root_device):
            seam.init_process_groups(self)
        self.failures.joined(self.num_nodes, self.world_size)
        # at this process's exit, gloo's workers finish with the interpreter before it finalises
        # (a worker freeing a tensor then would abort a rank whose work succeeded: docs/runtime.md)
        settle_collectives_at_exit()

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        module = self.lightning_module
        if not isinstance(module, DistMMMixin):
            raise TypeError(
                f"strategy='distmm' needs a LightningModule that mixes in lightning_distmm.DistMMMixin;"
                f" {type(module).__name__} does not"
            )
        self.accelerator.setup(trainer)
        if self.root_device.type == "cpu" and self._reuse_host_memory:
            keep_freed_host_memory()
        nodes = nodes_of_ranks(int(self.node_rank), self.world_size)
        self.failures.watch_nodes(nodes)
        self.plan = plan_of_run(self, trainer, module, nodes)
        rank_zero_info(f"distmm {self.plan.table()}")
        if self._overlap_batch_sync and not overlaps_batch_sync(self.plan):
            rank_zero_warn("distmm: overlap_batch_sync=True does nothing here: no tower runs schedule 'distmm'")
        if any(t.sharded for t in self.plan.towers.values()):
            # FSDP2 under torch.inference_mode (Lightning's standalone evaluation off gloo) makes its
            # all-gather buffers inference tensors, which break the forward or the training after it
            seam.evaluate_without_inference_mode(trainer)
        if self._replan is not None and trainer.state.fn == TrainerFn.FITTING:
            self._replan.prepare(self, trainer, module)
        precision = getattr(self.precision_plugin, "precision", None)
        self.engine = start_engine(
            module, self.plan, nodes, self.root_device, precision, self._bucket_cap_mb, self._overlap_batch_sync,
            values_from_checkpoint=self._refitting,
        )  # fmt: skip
        self._refitting = False
        module._distmm_runner = self.engine

        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # the distmm loader picks each rank's rows itself
        seam.disable_distributed_sampler(trainer)
        if self._saver is not None:
            self._saver.setup()  # its own process group, made by every rank here
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            ckpt.drop_remote_parameters(self.optimizers)
            for group in prepare_mixed_groups(self.optimizers, self.engine.gradients.shards):
                (warnings.warn if group.asked else _log.info)(f"distmm (rank {self.global_rank}): {group.describe()}")
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            seam.optimizers_to_device(self.optimizers, self.root_device)
            dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
            self._progress = elastic.ProgressNote(dirpath) if dirpath is not None else None

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)``: build on the meta device, recording how every tensor
        is initialised; in ``setup`` each rank materialises only what it holds (a sharded tower's
        shards) with the values an ordinary construction gives (``parallel.deferred``)."""
        with deferred_init() if empty_init else contextlib.nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        seam.move_held_tensors(self.model, self.root_device)  # released towers stay on the meta device

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if isinstance(module, DistMMMixin) and module._distmm_runner is self.engine:
            module._distmm_runner = None
        if self._saver is not None and not self._failed:
            self._saver.wait()  # a failed run leaves its save unfinished: never resumed from
        self.failures.stop()
        super().teardown()

    # ------------------------------------------------------------------ data
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank iterates the same global batches; the distmm loader slices them per rank
        return {"num_replicas": 1, "rank": 0}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not isinstance(dataloader, DataLoader) or self.engine is None or self.plan is None:
            return dataloader
        fields = {name: tower.fields for name, tower in self.engine.towers.items()}
        costs = {name: t.cost for name, t in self.engine.towers.items() if t.cost is not None}
        balance = self.plan.balance or self._balance  # the plan's key, else the strategy's argument
        costs = costs if balance == "cost" else {}
        return self._loaders.wrap(dataloader, self.plan, self.engine.layout, fields, costs)

    def _batches_done(self) -> int:
        return seam.batches_processed(self.lightning_module.trainer if self.lightning_module is not None else None)

    # ------------------------------------------------------------------ preemption
    @override
    def on_train_start(self) -> None:
        """SIGTERM ends the rank that gets it at once, with an error every other rank reports."""
        self.failures.handle_preemption(seam.launcher_kill(self))

    on_validation_start = on_train_start

    # ------------------------------------------------------------------ step
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """The step starts: Lightning zeroes the gradients after its ``training_step`` when it starts
        an accumulation window (the engine then drops the old ones before its backward)."""
        if self.engine is not None:
            trainer = self.lightning_module.trainer
            self.engine.start_step(zero_after=seam.zeroes_gradients_after_training_step(trainer, batch_idx))
            if self._progress is not None and self.global_rank == 0:
                self._progress.note(trainer.global_step + 1, self.world_size)  # the step now running, from 1

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning accumulates this step: its gradients stay local and the sums run once, in the
        optimizer step's backward (sums are linear, so that is exact)."""
        with self.engine.accumulating() if self.engine is not None else contextlib.nullcontext():
            yield None

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step, after checking that the step's gradients were handed back."""

        def closure_then_check() -> Any:
            out = closure()
            if self.engine is not None:
                self.engine.check_handed_back()
            return out

        return super().optimizer_step(optimizer, closure_then_check, model, **kwargs)

    # ------------------------------------------------------------------ failures
    @override
    def on_exception(self, exception: BaseException) -> None:
        """End every rank with the error that caused the failure (the earliest root cause any rank
        recorded), not with the broken pipe it left (:class:`~lightning_distmm.rank_failures.RankFailures`)."""
        self._failed = True
        super().on_exception(exception)
        self.failures.on_exception(exception, self.world_size)

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ckpt.for_dcp(ckpt.local_state_dict(self.lightning_module))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ckpt.for_dcp(ckpt.optimizer_state_dict(self.lightning_module, optimizer, self.engine.gradients.shards))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.plan is not None and self.lightning_module is not None:
            batch = seam.train_batch_size(self.lightning_module.trainer)
            checkpoint[ckpt.PLAN_KEY] = ckpt.plan_record(self.plan, batch)
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if self._saver is None or trainer is None or trainer.state.status != TrainerStatus.RUNNING:
            self.wait_for_saves()  # outside fit nothing waits for a save in flight: this one is written now
            super().save_checkpoint(checkpoint, filepath, storage_options)
        else:
            self._saver.save_folder(checkpoint, Path(self.broadcast(filepath)), self.global_rank == 0)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning drops an old checkpoint once it started the new one: with a save in flight, the
        old folder goes only when the new one is complete."""
        if self._saver is None:
            super().remove_checkpoint(filepath)
        elif self.is_global_zero:
            self._saver.remove(Path(filepath))

    def refit(self) -> str | None:
        """After a fit: the checkpoint to fit again from, under the plan a re-plan chose (the module
        rebuilt for it), or None. The launcher asks (:class:`~lightning_distmm.lightning_seam.launchers.Refitting`)."""
        path = self._replan.refit(self, self.lightning_module) if self._replan is not None else None
        self._refitting = path is not None
        return path

    def wait_for_saves(self) -> None:
        """Block until the asynchronous save in flight (``async_save=True``) is written; raise its error."""
        if self._saver is not None:
            self._saver.wait()

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Resume from a checkpoint folder under this run's plan (any plan for the same towers); a
        folder a lost node was still writing (``ckpt_path="last"`` after a failure) gives way to the
        newest complete one beside it, and the resume is logged in one line (``elastic.resume_line``)."""
        assert self.lightning_module is not None and self.plan is not None
        self.wait_for_saves()
        path, line = elastic.complete_or_newest(Path(self.broadcast(checkpoint_path)))
        if line is not None:
            rank_zero_info(line)
        ckpt.check_plan_change(path, self.plan)  # on every rank: all fail together
        loaded = ckpt.load_sharded(
            path, self.lightning_module, self.optimizers, weights_only=weights_only, shards=self.engine.gradients.shards
        )
        record = loaded.get(ckpt.PLAN_KEY) or {}
        before = Plan.from_dict(record["plan"]) if record.get("plan") else None
        step = int(loaded.get("global_step", 0))
        rank_zero_info(elastic.resume_line(path, step, before, self.plan, elastic.ProgressNote.read(path.parent)))
        return loaded
