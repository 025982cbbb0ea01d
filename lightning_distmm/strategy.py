"""``DistMMStrategy``: the Lightning wiring of a distmm plan.

A thin layer of hooks over reusable parts: :mod:`lightning_distmm.planner` says who runs what,
:mod:`lightning_distmm.parallel` builds the groups and runs the step, :mod:`lightning_distmm.data`
loads each rank's share, :mod:`lightning_distmm.checkpoint` saves and restores shards. It subclasses
Lightning's ``ModelParallelStrategy`` for process-group setup, launchers, DCP saving and
restore-after-setup, and replaces what assumes one model replicated or sharded alike on every rank.

One training step is one :class:`~lightning_distmm.parallel.step.StepState`: made when Lightning
starts the batch (``on_train_batch_start``: does Lightning zero the gradients after this
``training_step``), told whether its backward ends the optimizer step where Lightning decides it
(``block_backward_sync``), and passed to the runtime by the module's ``contrastive_loss`` and
``backward`` hooks through :class:`StepRunner`. Private Lightning accesses live in
:mod:`lightning_distmm.lightning_seam`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_distmm import checkpoint as ckpt
from lightning_distmm import faults
from lightning_distmm import lightning_seam as seam
from lightning_distmm.core.plan import Plan, PlanError, colocated_plan
from lightning_distmm.data.checks import check_dataloader
from lightning_distmm.data.loading import DistMMDataLoader
from lightning_distmm.mixin import DistMMMixin
from lightning_distmm.parallel.deferred import deferred_init
from lightning_distmm.parallel.executor import RankRuntime
from lightning_distmm.parallel.exit_settle import settle_collectives_at_exit
from lightning_distmm.parallel.flops import tower_counts
from lightning_distmm.parallel.fsdp import mixed_precision_policy
from lightning_distmm.parallel.groups import build_tower_groups
from lightning_distmm.parallel.host_allocator import keep_freed_host_memory
from lightning_distmm.parallel.step import StepState
from lightning_distmm.tower import TowerModule

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

PlanSpec = Plan | str | os.PathLike | None

#: how long a collective may wait before it fails: long enough for a slow checkpoint write, short
#: enough that a stalled rank ends the job in minutes, not Lightning's default half hour
DEFAULT_TIMEOUT = timedelta(minutes=10)
StartMethod = Literal["popen", "spawn", "fork"]


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
            of three integers (:mod:`lightning_distmm.data.agreement`). A dataset declared with
            :func:`lightning_distmm.data.rank_independent` is not checked.
        failure_grace: how long a rank waits, blocked, after another rank of its host recorded an error
            or died, before it ends itself with that rank's error (NCCL, unlike gloo, leaves it in the
            collective until the timeout; :class:`~lightning_distmm.faults.PeerFailureWatch`).
            ``None``: wait for the collective timeout.
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
    ) -> None:
        super().__init__(process_group_backend=process_group_backend, timeout=timeout)
        if int(stream_check_every) < 1:
            raise ValueError(
                f"stream_check_every={stream_check_every}: the ranks compare what they read every N >= 1 global"
                f" batches; to skip the check for a dataset, declare it with lightning_distmm.data.rank_independent"
            )
        self._stream_check_every = int(stream_check_every)
        self._bucket_cap_mb = float(bucket_cap_mb)
        self._reuse_host_memory = reuse_host_memory
        self._plan_spec = _parse_plan_spec(plan)
        self._start_method = start_method
        self.plan: Plan | None = self._plan_spec if isinstance(self._plan_spec, Plan) else None
        self.runtime: RankRuntime | None = None
        #: what the module calls under distmm, holding the step in progress (made in ``setup``)
        self.runner: StepRunner | None = None
        #: each rank's first error, readable by every rank after any rank's death (docs/runtime.md)
        self._relay: faults.ErrorRelay | None = None
        self._watchdog: faults.ParentWatchdog | None = None
        #: DataLoader batch sizes whose split of the plan's replica batches was already stated
        self._noted_batches: set[int] = set()
        self._failure_grace = failure_grace
        self._peer_watch: faults.PeerFailureWatch | None = None
        #: this rank's last line once it is failing (what a later clean-up SIGTERM repeats)
        self._last_words: str | None = None

    # ------------------------------------------------------------------ launch
    @override
    def _configure_launcher(self) -> None:
        # the first hook Lightning calls with the precision plugin in place, when the Trainer is built
        # (in the launching process and on every rank that builds it: all refuse alike)
        _check_precision(self.precision_plugin)
        assert self.cluster_environment is not None
        if self._start_method != "popen" or not self.cluster_environment.creates_processes_externally:
            # this process starts the ranks (popen's rank 0, the spawn/fork parent): a fresh run id
            # and its pid, set before any rank starts, so that every rank inherits them
            faults.note_launcher()
        faults.ensure_run_id()
        seam.configure_launcher(
            self, self._start_method, self._consolidated_state_dict, self._after_ranks_ended, self._release_runtime
        )

    def _after_ranks_ended(self) -> None:
        """In a spawn/fork parent once every rank has ended: remove the failure records that ranks
        which were stopped from outside could not remove themselves (this run's included: no rank
        of it is left to enter its folder)."""
        faults.remove_stale_runs(Path(tempfile.gettempdir()) / "distmm-runs", include_current=True)

    def _release_runtime(self) -> None:
        """On a spawn/fork rank whose work is done (the whole model handed to the parent): drop the
        runtime, whose per-tower meshes hold the towers' process groups, so that they end when the
        launcher destroys the default group rather than at the interpreter's exit."""
        self.runner = None
        self.runtime = None

    def _consolidated_state_dict(self) -> dict[str, Tensor] | None:
        return ckpt.consolidated_state_dict(self) if self.runtime is not None else None

    @override
    def setup_environment(self) -> None:
        # failure handling first: joining the process group is the first thing that can hang
        assert self.cluster_environment is not None
        started_by_launcher = self._start_method != "popen" or self.cluster_environment.creates_processes_externally
        if started_by_launcher and self._watchdog is None and threading.current_thread() is threading.main_thread():
            self._watchdog = faults.ParentWatchdog(rank=self.global_rank, cause=self._recorded_cause)
            self._watchdog.start()
        self._relay = faults.ErrorRelay(self._failure_folder(), self.global_rank)
        self._relay.register()
        self._last_words = None  # a new trainer call: no failure of this one yet
        seam.before_observer_ends_job(self._launcher_last_words)  # the popen launcher: its last words
        if self._failure_grace is not None and self._peer_watch is None:
            grace = self._failure_grace.total_seconds()
            self._peer_watch = faults.PeerFailureWatch(self._relay, self.world_size, grace=grace)
            self._peer_watch.start()
        # process groups only: the per-tower meshes need the module's towers, made in ``setup``.
        # Lightning re-seeds every generator from PL_GLOBAL_SEED there (reset_seed); the RNG state
        # the user's script reached (model built, same on every rank) is kept instead, so that an
        # unseeded sampler, dropout and the like draw what an ordinary single-process run draws
        # joining the store holds the interpreter lock, so the watchdog's thread cannot run: a rank
        # that a launcher started dies with it meanwhile (rank 0 failing to bind MASTER_PORT, say)
        # (only under our launchers, which start ranks from their main thread: the signal follows the
        # *thread* that started the process, and torchrun's agent starts workers from a thread that ends)
        ours = started_by_launcher and faults.started_by_our_launcher()
        dies_with_launcher = faults.dies_with_parent() if ours else contextlib.nullcontext()
        with dies_with_launcher, seam.random_state_kept(self.root_device):
            seam.init_process_groups(self)
        # at this process's exit, gloo's workers finish with the interpreter before it finalises
        # (a worker freeing a tensor then would abort a rank whose work succeeded: docs/runtime.md)
        settle_collectives_at_exit()

    def _launcher_last_words(self, ended: list[tuple[int, int | None]]) -> None:
        """Said by a popen launcher before Lightning's observer SIGKILLs it and its ranks (a rank ended
        badly): the recorded root cause, or which rank ended how. Its ranks are the next global ranks."""
        relay = self._relay
        line = faults.launcher_last_words(
            [(self.global_rank + i, code) for i, code in ended],
            lambda: relay.first(wait=2.0) if relay is not None else None,
        )
        if line is not None:
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def _recorded_cause(self) -> str | None:
        """The root cause other ranks recorded, if any (what a rank says when its launcher is gone)."""
        found = self._relay.first(wait=2.0) if self._relay is not None else None
        return found.describe() if found is not None and found.rank != self.global_rank else None

    def _failure_folder(self) -> Path:
        """Where the ranks of this run on this host record their failures (other runs whose processes
        are all gone are removed first; this run's folder is never touched here)."""
        root = Path(tempfile.gettempdir()) / "distmm-runs"
        run_id = faults.ensure_run_id()
        faults.remove_stale_runs(root)
        return root / run_id

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
        towers = module.tower_specs()
        nodes = self._nodes_of_ranks()
        if self.plan is None:
            self.plan = self._resolve_plan(trainer, module, nodes)
        self.plan.check_world(self.world_size)
        self.plan.check_towers(list(towers))
        _check_loss_semantics(self.plan, module)
        rank_zero_info(f"distmm {self.plan.table()}")
        if any(t.sharded for t in self.plan.towers.values()):
            # FSDP2 under torch.inference_mode (Lightning's standalone evaluation off gloo) makes its
            # all-gather buffers inference tensors, which break the forward or the training after it
            seam.evaluate_without_inference_mode(trainer)

        precision = getattr(self.precision_plugin, "precision", None)
        groups = build_tower_groups(self.plan, self.root_device.type, nodes, mixed_precision_policy(precision))
        self.runtime = RankRuntime(module, self.plan, groups, self.root_device, bucket_cap_mb=self._bucket_cap_mb)
        self.runtime.prepare_local_towers()
        self.runner = StepRunner(self.runtime)
        module._distmm_runner = self.runner

        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # the distmm loader picks each rank's rows itself
        seam.disable_distributed_sampler(trainer)
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
            ckpt.drop_remote_parameters(self.optimizers)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            seam.optimizers_to_device(self.optimizers, self.root_device)

    def _nodes_of_ranks(self) -> list[int]:
        """The node of every global rank, as the launcher numbers them (torchrun's GROUP_RANK,
        SLURM's node id): what HSDP's rows and node-aware placement go by."""
        nodes: list[int] = [0] * self.world_size
        torch.distributed.all_gather_object(nodes, int(self.node_rank))
        return nodes

    def _resolve_plan(self, trainer: pl.Trainer, module: DistMMMixin, nodes: list[int]) -> Plan:
        names = list(module.tower_specs())
        spec = self._plan_spec
        if spec == "colocated":
            return colocated_plan(names, self.world_size)
        if spec == "default":
            return self._default_plan(trainer, module)
        if spec == "auto":
            return self._auto_plan(trainer, module, nodes)
        raise PlanError(f"unknown plan {spec!r}")

    def _default_plan(self, trainer: pl.Trainer, module: DistMMMixin) -> Plan:
        """The planner's choice between the FLOP-proportional split, colocated and the other splits,
        priced from the towers' counts and this host's description (nothing timed): rank 0 prices,
        every rank gets its plan, and the log says what was chosen and its predicted ratio to the other."""
        from lightning_distmm.planner.default import CountedTower, Host, default_plan, describe_cpu

        data: tuple[Any, ...] | None = None
        if self.global_rank == 0:
            try:
                with seam.random_state_kept(self.root_device):  # rank 0 alone runs these forwards
                    counts = tower_counts(module.tower_specs(), seam.example_batch(trainer))
                per_node = max(1, self.num_processes)  # ranks per node
                if self.root_device.type == "cuda":
                    props = torch.cuda.get_device_properties(self.root_device)
                    host = Host("cuda", per_node, memory=float(props.total_memory), name=props.name)
                else:
                    host = describe_cpu(per_node, torch.get_num_threads())
                choice = default_plan(
                    {n: CountedTower(**c) for n, c in counts.items()},
                    self.world_size,
                    seam.train_batch_size(trainer),
                    host,
                    str(getattr(self.precision_plugin, "precision", "32")),
                )
                data = (choice.plan.to_dict(), choice.line(), None)
            except Exception as err:  # noqa: BLE001 - every rank fails with rank 0's reason
                data = (None, None, f"{type(err).__name__}: {err}")
        plan, line, error = self.broadcast(data, src=0)
        if error is not None:
            raise PlanError(f"the default plan could not be priced (rank 0): {error}")
        rank_zero_info(line)
        return Plan.from_dict(plan)

    def _auto_plan(self, trainer: pl.Trainer, module: DistMMMixin, nodes: list[int]) -> Plan:
        """The planner on profiles measured here: rank 0 measures and plans, every rank gets its plan.
        Its node-aware placement goes by the launcher's nodes (``nodes[rank]``), which must hold
        contiguous, equal blocks of ranks (as torchrun and SLURM number them)."""
        per_node = nodes.count(nodes[0])
        if nodes != [r // per_node for r in range(len(nodes))]:
            raise PlanError(f"plan='auto' places towers by node but the launcher's nodes of ranks 0.. are {nodes}")
        from lightning_distmm.planner.auto import auto_plan, tower_info_from_batch

        example, global_batch = seam.example_batch(trainer), seam.train_batch_size(trainer)
        if example is None or global_batch is None:
            raise PlanError("plan='auto' needs a training DataLoader with a batch_size to measure the towers on")
        data = None
        if self.global_rank == 0:
            infos = {n: tower_info_from_batch(t, example) for n, t in module.tower_specs().items()}
            # measured profiles price data parallelism per tower only (tp = pp = 1); the schedule
            # must compute the module's loss: distmm's two sync groups exactly when it asks for them
            schedules = ["distmm"] if module.sync_groups == 2 else ["gpipe", "cached"]
            options = {"max_tp": 1, "max_pp": 1, "schedules": schedules, "recompute": False}
            plan = auto_plan(infos, self.world_size, global_batch, self.root_device, options, per_node)
            data = plan.to_dict()
        return Plan.from_dict(self.broadcast(data, src=0))

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
        if module is not None and self.runner is not None and getattr(module, "_distmm_runner", None) is self.runner:
            module._distmm_runner = None
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._peer_watch is not None:
            self._peer_watch.stop()
            self._peer_watch = None
        super().teardown()

    # ------------------------------------------------------------------ data
    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # every rank iterates the same global batches; the distmm loader slices them per rank
        return {"num_replicas": 1, "rank": 0}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if not isinstance(dataloader, DataLoader) or self.runtime is None:
            return dataloader
        assert self.plan is not None
        # every rank checks every tower, so a bad dataset fails everywhere at once, before training
        check_dataloader(
            dataloader,
            {name: tower.fields for name, tower in self.runtime.towers.items()},
            {name: t.dp for name, t in self.plan.towers.items()},
            self.plan.sync_groups,
        )
        batch_size = getattr(dataloader.batch_sampler, "batch_size", None)
        if batch_size is not None:
            self.plan.check_global_batch(batch_size)
            note = self.plan.batch_note(batch_size)
            if note is not None and batch_size not in self._noted_batches:
                self._noted_batches.add(batch_size)
                rank_zero_info(f"distmm: {note}")
        return DistMMDataLoader(
            dataloader, self.runtime.layout, progress=self._batches_done, check_every=self._stream_check_every
        )

    def _batches_done(self) -> int:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return 0
        return trainer.fit_loop.epoch_loop.batch_progress.current.processed

    # ------------------------------------------------------------------ preemption
    @override
    def on_train_start(self) -> None:
        self._handle_preemption()

    @override
    def on_validation_start(self) -> None:
        self._handle_preemption()

    def _handle_preemption(self) -> None:
        """SIGTERM ends the rank that gets it at once, with an error every other rank reports.

        Installed over Lightning's handler, which broadcasts from inside the signal handler: a
        collective the other ranks never join, so every rank would wait until the timeout.
        """
        if threading.current_thread() is threading.main_thread():
            forward = getattr(self._launcher, "kill", None)  # the launcher passes it on to its ranks
            ended = lambda: self._last_words  # noqa: E731 - a failing rank's cause: a later SIGTERM is clean-up
            signal.signal(signal.SIGTERM, faults.preemption_handler(self.global_rank, forward, ended))

    # ------------------------------------------------------------------ step
    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        """The step starts: Lightning zeroes the gradients after its ``training_step`` when it starts
        an accumulation window (the runtime then drops the old ones before its backward)."""
        if self.runner is not None:
            trainer = self.lightning_module.trainer
            self.runner.step = StepState(zero_after=seam.zeroes_gradients_after_training_step(trainer, batch_idx))

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning accumulates this step: its gradients stay local and the sums run once, in the
        optimizer step's backward (sums are linear, so that is exact)."""
        step = self.runner.step if self.runner is not None else None
        if step is None:
            yield None
            return
        before, step.sync = step.sync, False  # sharded towers: the executor turns FSDP's sync off from it
        try:
            yield None
        finally:
            step.sync = before

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        """Lightning's optimizer step, after checking that the step's gradients were handed back."""

        def closure_then_check() -> Any:
            out = closure()
            if self.runner is not None and self.runner.step is not None:
                self.runner.step.check_handed_back()
            return out

        return super().optimizer_step(optimizer, closure_then_check, model, **kwargs)

    # ------------------------------------------------------------------ failures
    @override
    def on_exception(self, exception: BaseException) -> None:
        """End every rank with the error that caused the failure, not with the broken pipe it left.

        Each rank records its first error (with the time, and whether it is a consequence: a peer
        closed its connection mid-collective, a collective timed out) in the run's failure folder
        and reads every rank's: the earliest root cause is what every rank ends with. A rank that
        died without a word (SIGKILL, out of memory) or stalled is named as such.
        """
        super().on_exception(exception)
        first = self._first_failure(exception)
        if self._relay is not None:
            self._relay.finish(self.world_size)
        mine = f"rank {self.global_rank}: {type(exception).__name__}: {exception}"
        self._last_words = f"distmm: {first or mine}"
        if first is not None and not first.startswith(f"rank {self.global_rank}:"):
            raise DistMMRankFailure(f"distmm: {first}") from exception

    def _first_failure(self, exception: BaseException) -> str | None:
        stored = None
        if not faults.is_consequence(exception):
            stored = _record_first_failure(self.global_rank, exception)
        if self._relay is None:
            return stored
        mine = self._relay.record(exception)
        found = self._relay.first(wait=5.0 if mine.consequence else 0.0)
        if found is not None and found.consequence and stored is not None:
            return stored  # a root cause from a rank whose records this host cannot read
        return found.describe() if found is not None else stored

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ckpt.for_dcp(ckpt.local_state_dict(self.lightning_module))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        assert self.lightning_module is not None
        return ckpt.for_dcp(ckpt.optimizer_state_dict(self.lightning_module, optimizer))

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if self.plan is not None and self.lightning_module is not None:
            batch = seam.train_batch_size(self.lightning_module.trainer)
            checkpoint[ckpt.PLAN_KEY] = ckpt.plan_record(self.plan, batch)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None and self.plan is not None
        path = Path(self.broadcast(checkpoint_path))
        ckpt.check_plan_change(path, self.plan)  # on every rank: all fail together
        return ckpt.load_sharded(path, self.lightning_module, self.optimizers, weights_only=weights_only)


class DistMMRankFailure(RuntimeError):
    """Another rank failed first; the message is that rank's error."""


_FIRST_FAILURE_KEY = "distmm/first_failure"


def _record_first_failure(rank: int, exception: BaseException) -> str | None:
    """Write this rank's error to the store unless another rank's is there; return the first one
    (the channel across nodes that share no filesystem, while the store's host, rank 0, lives)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    mine = f"rank {rank}: {type(exception).__name__}: {exception}"
    try:
        store = seam.default_store()
        first = store.compare_set(_FIRST_FAILURE_KEY, "", mine)
    except Exception:  # noqa: BLE001 - the store's host may be gone already
        return None
    return first.decode() if isinstance(first, bytes) else str(first)


def _parse_plan_spec(plan: PlanSpec) -> Plan | str:
    if plan is None:
        return "default"
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return Plan.from_dict(plan)
    text = os.fspath(plan)
    if text in ("default", "colocated", "auto"):
        return text
    if not Path(text).is_file():
        raise FileNotFoundError(
            f"plan file {text!r} does not exist (plan= takes a Plan, a YAML path, 'default' or 'colocated')"
        )
    return Plan.from_yaml(Path(text))


def _check_precision(plugin: object) -> None:
    """Refuse a precision that scales the loss (``precision="16-mixed"``): its ``GradScaler`` looks for
    overflowed gradients among this rank's own, so under a distmm plan a rank that holds only the
    image tower skips a step that the text rank takes; the loss scales diverge and replicated
    parameters (``logit_scale``) drift apart. Lightning refuses ``16-mixed`` for
    ``ModelParallelStrategy`` instances only, so ``strategy="distmm"`` (a string) got past it."""
    if getattr(plugin, "scaler", None) is None:
        return
    precision = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"strategy='distmm' does not support precision={precision!r} (a loss scaler): its GradScaler decides"
        f" per rank whether the gradients overflowed, and each distmm rank holds different towers, so ranks"
        f" would skip different steps and their parameters drift apart. Use precision='bf16-mixed' (no loss"
        f" scaling needed; FSDP-sharded towers reduce their gradients in fp32) or '32-true'"
    )


def _check_loss_semantics(plan: Plan, module: DistMMMixin) -> None:
    """The plan's number of sync groups changes the loss; the module must have asked for that loss."""
    if plan.sync_groups != module.sync_groups:
        raise PlanError(
            f"the plan's schedule computes the loss over {plan.sync_groups} sync group(s) (each with its own negatives)"
            f" but {type(module).__name__}.sync_groups is {module.sync_groups}; set sync_groups = {plan.sync_groups} on the"
            f" module to train with that loss (the single-process reference then computes the same), or choose"
            f" {'another schedule' if plan.sync_groups > 1 else 'schedule: distmm'}"
        )


class StepRunner:
    """What the strategy installs on the module (:class:`~lightning_distmm.tower.TowerRunner`): the
    runtime, with the step in progress passed to it explicitly.

    ``step`` is the one piece of state carried between Lightning's hooks: made when the batch
    starts, it is what the module's ``contrastive_loss`` and ``backward`` calls hand the runtime.
    Outside a training batch (validation, ``trainer.validate``) a call gets a step of its own.
    """

    def __init__(self, runtime: RankRuntime) -> None:
        self.runtime = runtime
        self.step: StepState | None = None

    def _current(self) -> StepState:
        if self.step is None:
            self.step = StepState()
        return self.step

    def contrastive_loss(self, module: TowerModule, batch: Mapping[str, Any]) -> Tensor:
        return self.runtime.contrastive_loss(self._current(), module, batch)

    def global_batch_size(self, batch: Mapping[str, Any]) -> int:
        return self.runtime.global_batch_size(batch)

    def backward(self, run_backward: Callable[[], None]) -> None:
        self.runtime.backward(self._current(), run_backward)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self.runtime.clip_grad_norm_(max_norm, norm_type)
