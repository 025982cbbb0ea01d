"""Published CLIP training throughputs, and the cost model's prediction of each.

Why: a user decides from the planner's table, so its absolute step times must agree with what
real CLIP trainings measured. ``conf/published/clip_training.yaml`` lists measured runs (NVIDIA
NeMo's CLIP performance page, LAION's open_clip runs), each with its source, hardware, GPU count,
per-GPU batch and what the source says about its configuration. :func:`predict` prices *that*
configuration (plain data parallelism as the source ran it: every tower on every GPU, the
per-GPU batch as one microbatch, the source's precision, attention kernel and recomputation) with
the same cost model every plan goes through (:func:`~lightning_distmm.planner.cost.evaluate_plan`)
on a preset of the source's machine. Nothing here is fitted: an entry the model does not reach
within :data:`TOLERANCE` is marked ``reached: false`` with the reason in the file.

Partial recomputation (NeMo's ``activations_checkpoint_num_layers: 8`` of 40 layers) is priced
as that fraction of the tower's full-recompute cost: recomputing one block adds its forward, the
same for every block of a tower.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from lightning_distmm.planner.cost import RECOMPUTE, CostOptions, StepCost, TowerChoice, evaluate_plan
from lightning_distmm.planner.machine.cluster import Cluster
from lightning_distmm.planner.machine.config import CONF_DIR
from lightning_distmm.planner.measure.local import load_cluster
from lightning_distmm.planner.profiles.profile import TowerProfile, model_profiles

PUBLISHED_FILE = CONF_DIR / "published" / "clip_training.yaml"
TOLERANCE = 0.25
"""A prediction agrees with a measurement when ``|predicted / measured - 1| <= TOLERANCE``."""


@dataclass(frozen=True)
class RunModel:
    """How a published run's model was built and run: a ``conf/model`` preset with tower overrides,
    the precision, whether attention was fused (FlashAttention) and how many blocks of each tower
    were recomputed in the backward."""

    preset: str
    source: str = ""  # the file's source that states this configuration
    towers: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    precision: str = "bf16-mixed"
    flash_attention: bool = True
    recompute_layers: Mapping[str, int] = field(default_factory=dict)
    autocast: bool = True  # False: Megatron's O2 (bf16 weights and residual stream, fp32 main copy)
    overlap_grad_sync: bool = True  # False: the gradient all-reduce runs after the backward
    separate_bias: bool = False  # Megatron's linear: bias adds and bias gradients as their own passes
    torch_softmax: tuple[str, ...] = ()  # towers whose softmax runs as fp32 PyTorch ops (no fused kernel)

    def __post_init__(self) -> None:
        object.__setattr__(self, "torch_softmax", tuple(self.torch_softmax))

    def config(self) -> dict[str, Any]:
        """The model config: the preset with the overrides applied."""
        cfg = yaml.safe_load((CONF_DIR / "model" / f"{self.preset}.yaml").read_text())
        cfg = copy.deepcopy(cfg)
        for name, over in self.towers.items():
            cfg["towers"][name].update(dict(over))
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            **({"source": self.source} if self.source else {}),
            **({"towers": {k: dict(v) for k, v in self.towers.items()}} if self.towers else {}),
            "precision": self.precision,
            "flash_attention": self.flash_attention,
            **({"recompute_layers": dict(self.recompute_layers)} if self.recompute_layers else {}),
            **({} if self.autocast else {"autocast": False}),
            **({} if self.overlap_grad_sync else {"overlap_grad_sync": False}),
            **({"separate_bias": True} if self.separate_bias else {}),
            **({"torch_softmax": list(self.torch_softmax)} if self.torch_softmax else {}),
        }


@dataclass(frozen=True)
class Published:
    """One measured training run: ``samples_per_s`` over ``gpus`` GPUs of ``cluster`` (a
    ``conf/cluster`` preset of the source's machine) at ``per_gpu_batch`` samples per GPU."""

    key: str
    source: str
    model: str
    cluster: str
    gpus: int
    per_gpu_batch: int
    samples_per_s: float
    cluster_source: str = ""
    reached: bool = True
    reason: str = ""

    @property
    def global_batch(self) -> int:
        return self.gpus * self.per_gpu_batch

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass
class PublishedSet:
    """The file: sources by name, the runs, why an entry is not reached (by name), and how each
    model was run."""

    sources: dict[str, str]
    entries: list[Published]
    models: dict[str, RunModel]
    reasons: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PublishedSet:
        models = {k: RunModel(**v) for k, v in data["models"].items()}
        entries = [Published(**e) for e in data["entries"]]
        out = cls(dict(data["sources"]), entries, models, dict(data.get("reasons") or {}))
        for k, m in models.items():
            if m.source and m.source not in out.sources:
                raise ValueError(f"published model {k!r}: no source {m.source!r} in the file's sources")
        for e in entries:
            if e.model not in models:
                raise ValueError(f"published entry {e.key!r}: no model {e.model!r} in the file's models")
            if e.source not in out.sources:
                raise ValueError(f"published entry {e.key!r}: no source {e.source!r} in the file's sources")
            if not e.reached and e.reason not in out.reasons:
                raise ValueError(
                    f"published entry {e.key!r} is marked unreached without a reason in the file's reasons"
                )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "sources": dict(self.sources),
            "entries": [e.to_dict() for e in self.entries],
            "reasons": dict(self.reasons),
            "models": {k: m.to_dict() for k, m in self.models.items()},
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False, width=120)

    @classmethod
    def from_yaml(cls, text: str) -> PublishedSet:
        return cls.from_dict(yaml.safe_load(text))


def load_published(path: Any = PUBLISHED_FILE) -> PublishedSet:
    """The published measurements (``conf/published/clip_training.yaml`` by default)."""
    return PublishedSet.from_yaml(open(path).read())


@dataclass
class Prediction:
    """The cost model's view of one published run."""

    entry: Published
    step_time: float
    samples_per_s: float
    model_flops_per_sample: float
    cost: StepCost
    cluster: Cluster

    @property
    def ratio(self) -> float:
        """Predicted over measured throughput (above 1: the model is optimistic)."""
        return self.samples_per_s / self.entry.samples_per_s

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1.0) <= TOLERANCE

    def mfu(self, measured: bool = False) -> float:
        """Model FLOPs utilisation (forward + backward FLOPs, recomputation not counted) of the
        predicted or the measured throughput, against the datasheet peak."""
        sps = self.entry.samples_per_s if measured else self.samples_per_s
        return sps * self.model_flops_per_sample / (self.entry.gpus * self.cluster.device.peak_flops)


def run_choices(profiles: Mapping[str, TowerProfile], gpus: int, mb: int, recompute: bool | str) -> dict:
    """Every tower on every GPU with ``mb`` samples each (data parallelism as the sources ran it);
    ``recompute``: every tower (True), none (False) or the tower of that name."""
    return {
        n: TowerChoice(n, gpus, 1, 1, mb, RECOMPUTE if recompute is True or recompute == n else "gpipe", (mb,) * gpus)
        for n in profiles
    }


def run_options(run: RunModel) -> CostOptions:
    """The cost model's software assumptions as ``run``'s source states them."""
    return CostOptions(
        precision=run.precision,
        flash_attention=run.flash_attention,
        autocast=run.autocast,
        overlap_grad_sync=run.overlap_grad_sync,
        separate_bias=run.separate_bias,
        torch_softmax_towers=tuple(run.torch_softmax),
    )


def predict(entry: Published, run: RunModel) -> Prediction:
    """Price ``entry``'s configuration on its machine (see the module docstring)."""
    profiles = model_profiles(run.config())
    base = load_cluster(entry.cluster)
    cl = base.with_world(entry.gpus) if entry.gpus <= base.devices_per_node else base
    if entry.gpus > base.devices_per_node:
        if entry.gpus % base.devices_per_node:
            raise ValueError(f"{entry.key}: {entry.gpus} GPUs do not fill nodes of {base.devices_per_node}")
        cl = dataclasses.replace(base, nodes=entry.gpus // base.devices_per_node)
    opts = run_options(run)
    ranks = {n: list(range(entry.gpus)) for n in profiles}
    G, mb = entry.global_batch, entry.per_gpu_batch
    cost = evaluate_plan(profiles, cl, opts, run_choices(profiles, entry.gpus, mb, False), ranks, G)
    step = cost.step_time
    for name, layers in run.recompute_layers.items():
        if layers:
            full = evaluate_plan(profiles, cl, opts, run_choices(profiles, entry.gpus, mb, name), ranks, G)
            step += layers / profiles[name].layers * (full.step_time - cost.step_time)
    flops = sum(p.train_flops_per_sample() for p in profiles.values())
    return Prediction(entry, step, G / step, flops, cost, cl)


def predict_all(published: PublishedSet | None = None) -> list[Prediction]:
    """:func:`predict` for every entry of the file."""
    data = published or load_published()
    return [predict(e, data.models[e.model]) for e in data.entries]


def table(predictions: list[Prediction], reasons: Mapping[str, str] | None = None) -> str:
    """The predictions beside the measurements, one line per entry, and the reason of each entry
    the model does not reach (``reasons``: the file's, by name)."""
    head = (
        f"{'entry':<24} {'machine':<15} {'GPUs':>5} {'/GPU':>5} {'measured':>9} {'predicted':>9}"
        f" {'ratio':>6} {'MFU meas':>8} {'MFU pred':>8}  status"
    )
    lines = [head, "-" * len(head)]
    for p in predictions:
        e = p.entry
        status = "ok" if p.within else ("OUT (marked unreached)" if not e.reached else "OUT")
        lines.append(
            f"{e.key:<24} {e.cluster:<15} {e.gpus:>5} {e.per_gpu_batch:>5} {e.samples_per_s:>9.0f}"
            f" {p.samples_per_s:>9.0f} {p.ratio:>6.2f} {p.mfu(True):>8.1%} {p.mfu():>8.1%}  {status}"
        )
    named: dict[str, list[str]] = {}
    for p in predictions:
        if not p.entry.reached:
            named.setdefault(p.entry.reason, []).append(p.entry.key)
    for reason, keys in named.items():
        lines.append(f"\nnot reached ({', '.join(keys)}):\n  {(reasons or {}).get(reason, reason)}")
    return "\n".join(lines)


__all__ = [
    "PUBLISHED_FILE",
    "TOLERANCE",
    "RunModel",
    "Published",
    "PublishedSet",
    "Prediction",
    "load_published",
    "run_choices",
    "run_options",
    "predict",
    "predict_all",
    "table",
]
