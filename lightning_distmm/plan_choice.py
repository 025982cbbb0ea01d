"""The plan of a run: a plan given (a Plan, a YAML file) or chosen at setup (``"default"``,
``"auto"``, ``"colocated"``), and the checks of the run's settings against it.

Rank 0 prices (or measures and prices) and the strategy broadcasts what it chose, so every rank
runs the same plan: :func:`choose_on_rank0` returns the plan as a dictionary, the line to log and,
instead of raising, the error with the file and line it was raised at (every rank then fails with
rank 0's reason rather than waiting for a broadcast that never comes; the traceback stays on rank 0). The pricing is the planner's (:mod:`lightning_distmm.planner.default`,
:mod:`lightning_distmm.planner.auto`); what is read from the live job (its towers, a sample batch,
the device, the precision) is gathered into a :class:`LiveJob`. :func:`plan_of_run` is what the
strategy's ``setup`` calls.
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_distmm import lightning_seam as seam
from lightning_distmm.core.plan import Plan, PlanError, colocated_plan
from lightning_distmm.parallel.flops import tower_counts
from lightning_distmm.parallel.plan_checks import check_plan_runs
from lightning_distmm.tower import Tower

if TYPE_CHECKING:  # pragma: no cover
    import lightning.pytorch as pl

    from lightning_distmm.planner.default import Host


@dataclass
class LiveJob:
    """What choosing a plan reads from the live job."""

    towers: dict[str, Tower]
    #: the module's sync groups (``distmm``'s loss needs 2)
    sync_groups: int
    #: one batch of the training DataLoader and its batch size (None: no loader yet)
    example: Mapping[str, Any] | None
    global_batch: int | None
    world_size: int
    #: ranks per node
    per_node: int
    device: torch.device
    #: Lightning's precision name and its forward context (``bf16-mixed``: autocast)
    precision: str
    forward_context: Callable[[], Any]
    #: keeps the RNG state while rank 0 alone runs forwards
    random_state_kept: Callable[[torch.device], Any]


def plan_of_run(strategy: Any, trainer: pl.Trainer, module: Any, nodes: list[int]) -> Plan:
    """The plan this run trains with, on every rank: the one given (or chosen at an earlier setup), or the one rank 0 chose
    (``"default"``, ``"auto"``, ``"colocated"``) and broadcast (every rank fails with rank 0's reason
    when it could not be chosen); checked against the world size, the towers and the module's loss."""
    spec = strategy._plan_spec
    if isinstance(spec, PlansByWorldSize):
        spec = spec.for_world(strategy.world_size)
        if strategy.plan is None and isinstance(spec, Plan):
            strategy.plan = spec
        rank_zero_info(
            f"distmm: world of {strategy.world_size} ranks: the plan for it from {strategy._plan_spec.source}"
            f" ({spec if isinstance(spec, str) else 'a plan of ' + str(len(spec.towers)) + ' towers'})"
        )
    if strategy.plan is not None:  # given, or chosen at an earlier setup of this strategy (fit, then test)
        plan = strategy.plan
    else:
        per_node = check_nodes_for_auto(nodes) if spec == "auto" else max(1, strategy.num_processes)
        data: tuple[Any, ...] | None = None
        if strategy.global_rank == 0:
            precision_plugin = strategy.precision_plugin
            job = LiveJob(
                towers=module.tower_specs(),
                sync_groups=module.sync_groups,
                example=seam.example_batch(trainer),
                global_batch=seam.train_batch_size(trainer),
                world_size=strategy.world_size,
                per_node=per_node,
                device=strategy.root_device,
                precision=str(getattr(precision_plugin, "precision", "32-true")),
                forward_context=precision_plugin.forward_context,
                random_state_kept=seam.random_state_kept,
            )
            data = choose_on_rank0(str(spec), job)
        chosen, line, error = strategy.broadcast(data, src=0)
        if error is not None:
            raise PlanError(f"the {spec} plan could not be chosen (rank 0): {error}")
        if line is not None:
            rank_zero_info(line)
        plan = Plan.from_dict(chosen)
    plan.check_world(strategy.world_size)
    towers = module.tower_specs()
    plan.check_towers(list(towers))
    check_plan_runs(plan, towers)
    check_loss_semantics(plan, module)
    batch = seam.train_batch_size(trainer)
    if batch is not None:  # how the run's batches split, before any group is built
        plan.check_batch_split(batch)
    return plan


def check_nodes_for_auto(nodes: list[int]) -> int:
    """Ranks per node for ``plan="auto"``'s node-aware placement, which needs contiguous, equal
    blocks of ranks per node (as torchrun and SLURM number them). On every rank: all refuse alike."""
    per_node = nodes.count(nodes[0])
    if nodes != [r // per_node for r in range(len(nodes))]:
        raise PlanError(f"plan='auto' places towers by node but the launcher's nodes of ranks 0.. are {nodes}")
    return per_node


def choose_on_rank0(spec: str, job: LiveJob) -> tuple[dict | None, str | None, str | None]:
    """``(plan.to_dict(), line to log, None)``, or ``(None, None, error)`` when it could not be chosen."""
    try:
        if spec == "colocated":
            return colocated_plan(list(job.towers), job.world_size).to_dict(), None, None
        if spec == "default":
            return default_choice(job)
        if spec == "auto":
            return auto_choice(job)
        raise PlanError(f"unknown plan {spec!r}")
    except PlanError as err:  # a plan that cannot be: its message says why, not where
        return None, None, f"{type(err).__name__}: {err}"
    except Exception as err:  # noqa: BLE001 - every rank fails with rank 0's reason
        return None, None, f"{type(err).__name__}: {err}{raised_at(err)}"


def raised_at(err: BaseException) -> str:
    """Where ``err`` was raised, for a message that crosses to other ranks without its traceback:
    `` (raised at FILE:LINE in FUNCTION)``, the traceback's innermost frame, and, when that frame is
    a library's (torch's, Lightning's, this package's, Python's), the innermost frame of the code
    that called it (``, from model.py:42 in forward``); empty without a traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    where = f"raised at {last.filename}:{last.lineno} in {last.name}"
    own = [f for f in frames if not _in_library(f.filename)]
    if own and own[-1] is not last:
        where += f", from {own[-1].filename}:{own[-1].lineno} in {own[-1].name}"
    return f" ({where})"


def _in_library(filename: str) -> bool:
    """Whether ``filename`` is torch's, Lightning's, this package's or Python's own (not an installed package's)."""
    import lightning

    def under(folders: list[Path]) -> bool:
        return any(path.is_relative_to(f) for f in folders)

    path = Path(filename).resolve()
    paths = sysconfig.get_paths()
    packages = [Path(m.__file__).parent.resolve() for m in (torch, lightning)] + [Path(__file__).parent.resolve()]
    python = [Path(paths[k]).resolve() for k in ("stdlib", "platstdlib")]
    installed = [Path(paths[k]).resolve() for k in ("purelib", "platlib")]
    return under(packages) or (under(python) and not under(installed))


def default_choice(job: LiveJob) -> tuple[dict, str, None]:
    """The planner's choice between the FLOP-proportional split, colocated and the other splits,
    priced from the towers' counts and this host's description (nothing timed)."""
    from lightning_distmm.planner.default import CountedTower, default_plan

    with job.random_state_kept(job.device):  # rank 0 alone runs these forwards
        counts = tower_counts(job.towers, job.example)
    host = describe_host(job.device, job.per_node)
    pair = producer_consumer(job.towers)
    if pair is not None:  # an encoder feeding a language model: the VLM search
        from lightning_distmm.planner.vlm.default import default_vlm_plan

        counted = {n: CountedTower(**c) for n, c in counts.items()}
        vlm = default_vlm_plan(counted, *pair, job.world_size, job.global_batch, host, job.precision)
        return vlm.plan.to_dict(), vlm.line(), None
    choice = default_plan(
        {n: CountedTower(**c) for n, c in counts.items()}, job.world_size, job.global_batch, host, job.precision
    )
    return choice.plan.to_dict(), choice.line(), None


def describe_host(device: torch.device, per_node: int) -> Host:
    """This rank's machine as the default plan prices it: a GPU by its name and memory, a CPU by
    :func:`~lightning_distmm.planner.default.describe_cpu` with this process's torch threads."""
    from lightning_distmm.planner.default import Host, describe_cpu

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Host("cuda", per_node, memory=float(props.total_memory), name=props.name)
    return describe_cpu(per_node, torch.get_num_threads())


def producer_consumer(towers: Mapping[str, Tower]) -> tuple[str, str] | None:
    """``(producer, consumer)`` when the model is one tower feeding another (an encoder and its
    language model), which the VLM search plans; None otherwise (the contrastive default)."""
    consumers = [n for n, t in towers.items() if t.consumes]
    if len(towers) != 2 or len(consumers) != 1 or len(towers[consumers[0]].consumes) != 1:
        return None
    return next(iter(towers[consumers[0]].consumes)), consumers[0]


def auto_choice(job: LiveJob) -> tuple[dict, str | None, None]:
    """The planner on tower profiles measured here, in the run's precision, one tower at a time
    (an encoder feeding a language model: the VLM search)."""
    from lightning_distmm.planner.auto import auto_plan, tower_info_from_batch
    from lightning_distmm.planner.cost.options import PRECISION_ALIASES

    if job.example is None or job.global_batch is None:
        raise PlanError("plan='auto' needs a training DataLoader with a batch_size to measure the towers on")
    produced = producer_outputs(job.towers, job.example, job.random_state_kept, job.device)
    infos = {n: tower_info_from_batch(t, job.example, produced=produced) for n, t in job.towers.items()}
    pair = producer_consumer(job.towers)
    if pair is not None:
        from lightning_distmm.parallel.flops import output_vectors
        from lightning_distmm.planner.vlm.default import auto_vlm_plan

        tokens, width = output_vectors(produced[pair[0]])
        if width is None:
            raise PlanError(f"tower {pair[0]!r} feeds {pair[1]!r} but its output holds no tensor")
        vlm = auto_vlm_plan(
            infos,
            *pair,
            tokens,
            width,
            job.world_size,
            job.global_batch,
            job.device,
            job.per_node,
            job.forward_context,
            job.precision if job.precision in PRECISION_ALIASES else None,
        )
        return vlm.plan.to_dict(), vlm.line("auto"), None
    # measured profiles price data parallelism per tower only (tp = pp = 1); the schedule must
    # compute the module's loss: distmm's two sync groups exactly when it asks for them
    schedules = ["distmm"] if job.sync_groups == 2 else ["gpipe", "cached"]
    options: dict[str, Any] = {"max_tp": 1, "max_pp": 1, "schedules": schedules, "recompute": False}
    if job.precision in PRECISION_ALIASES:  # priced in the precision the run computes in
        options["precision"] = job.precision
    plan = auto_plan(
        infos, job.world_size, job.global_batch, job.device, options, job.per_node, autocast=job.forward_context
    )
    return plan.to_dict(), None, None


def producer_outputs(
    towers: Mapping[str, Tower],
    example: Mapping[str, Any],
    random_state_kept: Callable[[torch.device], Any],
    device: torch.device,
) -> dict[str, Any]:
    """Each consumed tower's output for ``example`` (no gradients), what its consumer is measured on."""
    from lightning_distmm.parallel.flops import check_consumer_call, consumer_inputs
    from lightning_distmm.tower import tower_order

    needed = {p for t in towers.values() for p in t.consumes}
    produced: dict[str, Any] = {}
    with random_state_kept(device), torch.no_grad():
        for name in tower_order(towers):
            tower = towers[name]
            check_consumer_call(name, tower)
            if name not in needed:
                continue
            missing = [f for f in tower.fields if f not in example]
            if missing:
                raise PlanError(
                    f"plan='auto' measures tower {name!r} on the training batch, which has no field(s) {missing}"
                )
            was_training = tower.module.training
            tower.module.eval()
            try:
                produced[name] = tower.module(
                    *(example[f] for f in tower.fields), **consumer_inputs(name, tower, produced)
                )
            finally:
                tower.module.train(was_training)
    return produced


#: what ``DistMMStrategy(plan=...)`` takes
PlanSpec = Plan | str | os.PathLike | Mapping[Any, Any] | None


@dataclass(frozen=True)
class PlansByWorldSize:
    """A plan spec per world size (``plan={8: "big.yaml", 4: "small.yaml"}``, or a folder of
    ``<world size>.yaml`` files): the run trains with the entry for the world it finds at setup,
    so that a job restarted on fewer nodes (torchrun's elastic restart) takes the plan written for
    them. An entry is anything ``plan=`` takes ("auto", a YAML path, a Plan, a plan dictionary)."""

    plans: Mapping[int, Plan | str]
    source: str

    def for_world(self, world_size: int) -> Plan | str:
        if world_size not in self.plans:
            sizes = ", ".join(str(w) for w in sorted(self.plans))
            raise PlanError(
                f"the plans by world size ({self.source}) have none for a world of {world_size} ranks (entries:"
                f" {sizes}): add one for {world_size} (a plan file, or 'auto' to let the planner choose)",
                "plan",
            )
        return self.plans[world_size]


def _world_key(key: Any) -> int | None:
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    return int(key) if isinstance(key, str) and key.isdigit() else None


def parse_plan_spec(plan: PlanSpec) -> Plan | str | PlansByWorldSize:
    """``DistMMStrategy(plan=...)``: a Plan, the name of a plan chosen at setup, or plans by world size."""
    if plan is None:
        return "default"
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        keys = [_world_key(k) for k in plan]
        if plan and all(k is not None for k in keys):  # {4: ..., 8: ...}: a plan per world size
            entries = {k: parse_plan_spec(v) for k, v in zip(keys, plan.values(), strict=True)}
            return PlansByWorldSize(_single(entries), "plan=" + str(sorted(entries)))
        return Plan.from_dict(plan)
    text = os.fspath(plan)
    if text in ("default", "colocated", "auto"):
        return text
    if Path(text).is_dir():
        files = {int(f.stem): f for f in Path(text).glob("*.yaml") if f.stem.isdigit()}
        if not files:
            raise FileNotFoundError(
                f"plan folder {text!r} holds no '<world size>.yaml' file (a folder of plans by world size: 4.yaml,"
                " 8.yaml, ...)"
            )
        return PlansByWorldSize({w: Plan.from_yaml(f) for w, f in files.items()}, f"folder {text}")
    if not Path(text).is_file():
        raise FileNotFoundError(
            f"plan file {text!r} does not exist (plan= takes a Plan, a YAML path, a folder of <world size>.yaml"
            " plans, a mapping of world size to plan, 'default', 'auto' or 'colocated')"
        )
    return Plan.from_yaml(Path(text))


def _single(entries: Mapping[int, Plan | str | PlansByWorldSize]) -> dict[int, Plan | str]:
    out: dict[int, Plan | str] = {}
    for world, entry in entries.items():
        if isinstance(entry, PlansByWorldSize):
            raise PlanError(f"plan for world size {world}: a plan by world size cannot hold another", "plan")
        if isinstance(entry, Plan) and entry.world_size != world:
            raise PlanError(f"the plan given for world size {world} is a plan for {entry.world_size} ranks", "plan")
        out[world] = entry
    return out


def check_precision(plugin: object) -> None:
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


def check_loss_semantics(plan: Plan, module: Any) -> None:
    """The plan's number of sync groups changes the loss; the module must have asked for that loss."""
    if plan.sync_groups != module.sync_groups:
        raise PlanError(
            f"the plan's schedule computes the loss over {plan.sync_groups} sync group(s) (each with its own negatives)"
            f" but {type(module).__name__}.sync_groups is {module.sync_groups}; set sync_groups = {plan.sync_groups} on the"
            f" module to train with that loss (the single-process reference then computes the same), or choose"
            f" {'another schedule' if plan.sync_groups > 1 else 'schedule: distmm'}"
        )


__all__ = [
    "LiveJob",
    "PlanSpec",
    "check_loss_semantics",
    "check_nodes_for_auto",
    "check_precision",
    "choose_on_rank0",
    "parse_plan_spec",
    "plan_of_run",
    "raised_at",
]
