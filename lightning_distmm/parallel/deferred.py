"""Towers built on the meta device and materialised as each rank's piece, with the values of an ordinary construction.

``with deferred_init(): module = MyCLIP()`` (what ``trainer.init_module(empty_init=True)`` does
under distmm) builds every tensor on the meta device, so building costs no memory, and records
the aten operations that initialise them (a ``TorchDispatchMode``: factories, in-place
initialisers, the arithmetic between them). On exit the recording is replayed once into
throwaway tensors, so that the random generator ends where an ordinary construction leaves it
(what the script draws next is the same).

Once a rank is prepared (remote towers released, pipelines cut, towers sharded: parameters are
DTensors whose local pieces are still on the meta device), :func:`materialize` allocates only
what the rank holds and replays the recording again from the generator state the construction
started from: each tensor is computed whole, one at a time (a storage is freed as soon as no
later operation reads it, or when the next one overwrites it whole without reading it, as
``trunc_normal_`` overwrites what ``reset_parameters`` drew), and only the rank's piece of it is
kept (a DTensor's local shard, cut locally). The values equal an ordinary construction's bit for
bit: the same operations draw the same numbers in the same order, on the CPU (the default
device a module is built on).

Not recorded, so refused with a message: random draws into tensors explicitly made on a real
device inside the context, and real tensors written from meta ones. Reading a meta tensor's
values (``.item()``, ``if t.any()``) fails in torch itself. Real tensors read by a recorded
operation (a constant computed on the CPU) are kept with the recording until it is dropped.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

_META = torch.device("meta")
#: in-place operations that overwrite their first argument without reading it
_OVERWRITE = {
    "uniform_",
    "normal_",
    "random_",
    "bernoulli_",
    "exponential_",
    "cauchy_",
    "log_normal_",
    "geometric_",
    "fill_",
    "zero_",
    "copy_",
}


#: operations that wrap a tensor made from data (``torch.tensor``): a meta one has lost its values
_FRESH = {torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default}


def _key(t: Tensor) -> int:
    """The identity of ``t``'s storage (shared by its views, ``detach()``, ``.data`` and the
    ``nn.Parameter`` made from it)."""
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class _Ref:
    """A meta tensor in a recorded operation: its storage and its view of it."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, t: Tensor) -> _Ref:
        return cls(_key(t), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)

    def covers(self, nbytes: int) -> bool:
        """Whether this view is its whole storage, contiguous."""
        contiguous, expected = True, 1
        for size, stride in zip(reversed(self.size), reversed(self.stride)):
            if size != 1 and stride != expected:
                contiguous = False
            expected *= size
        itemsize = torch.empty((), dtype=self.dtype, device=_META).element_size()
        return contiguous and self.offset == 0 and math.prod(self.size) * itemsize == nbytes

    def on(self, storage: torch.UntypedStorage, device: torch.device) -> Tensor:
        return torch.empty(0, dtype=self.dtype, device=device).set_(storage, self.offset, self.size, self.stride)


@dataclass
class _Op:
    func: Any
    args: Any
    kwargs: Any
    outs: list[_Ref | None]
    dtype: torch.dtype  # the default dtype when it ran (factories without a dtype use it)
    reads: set[int]
    defines: set[int]
    creates: set[int]
    rng: Tensor | None = None  # the generator's state, when the construction re-seeded it before this draw


@dataclass(eq=False)
class Recording:
    """The operations that initialised the meta tensors built under one :func:`deferred_init`."""

    rng: Tensor  # the CPU generator's state when the construction started
    device: torch.device  # where the construction would have run (its generator draws)
    ops: list[_Op] = field(default_factory=list)
    nbytes: dict[int, int] = field(default_factory=dict)
    #: explicit generators the operations used, with their state before the first draw
    generators: dict[int, tuple[torch.Generator, Tensor | None]] = field(default_factory=dict)
    _alive: list[Tensor] = field(default_factory=list)  # every meta tensor seen: storage keys stay unique
    _state: Tensor | None = None  # the generator's state at the last draw recorded (meta draws do not move it)

    def add(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        meta_in = [t for t in inputs if t.is_meta]
        meta_out = [t for t in outputs if t.is_meta]
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        written = _written(func, args, kwargs)
        if not meta_in and not meta_out:
            if seeded:
                raise RuntimeError(
                    f"deferred init: {func} draws random numbers into a tensor on"
                    f" {outputs[0].device if outputs else 'a real device'}; inside the context every tensor must be"
                    " made on the default device (no device=...), so that its draws can be replayed in order"
                )
            return
        if any(not t.is_meta for t in written):
            raise RuntimeError(f"deferred init: {func} writes a value computed on the meta device into a real tensor")
        if func in _FRESH and any(_key(t) not in self.nbytes for t in meta_in):
            raise RuntimeError(
                "deferred init: a meta tensor was made from data in a way the recording cannot see (its values are"
                " lost); make it with torch.tensor(...) or a factory inside the context, or build the module as usual"
            )
        if func.is_view or (not meta_out and not func._schema.is_mutable):
            return  # an alias (later operations read it by its view) or a query of sizes
        known = set(self.nbytes)
        for t in meta_in + meta_out:
            self.nbytes.setdefault(_key(t), t.untyped_storage().nbytes())
            self._alive.append(t)
        defines: set[int] = set()
        name = func._schema.name.split("::")[-1]
        if name in _OVERWRITE and len(written) == 1 and _Ref.of(written[0]).covers(self.nbytes[_key(written[0])]):
            target = _key(written[0])
            if not any(_key(t) == target for t in meta_in if t is not written[0]):
                defines.add(target)
        reads = {_key(t) for t in meta_in} - defines
        creates = {_key(t) for t in meta_out} - known
        encoded = tree_map(_encode, (args, kwargs))
        outs = [_Ref.of(t) if t.is_meta else None for t in outputs]
        op = _Op(func, encoded[0], encoded[1], outs, torch.get_default_dtype(), reads, defines, creates)
        if seeded and self.reseeded():  # torch.manual_seed inside the construction: replay from there
            op.rng = self._state = torch.get_rng_state()
        self.ops.append(op)

    def reseeded(self) -> bool:
        """Whether the generator's state moved since the last draw recorded (meta draws leave it): the
        construction seeded it."""
        return not torch.equal(torch.get_rng_state(), self.rng if self._state is None else self._state)

    def replay(self, sinks: Mapping[int, list[Callable[[torch.UntypedStorage], None]]] | None = None) -> None:
        """Run the recorded operations for real, in order, each storage allocated only while its value
        is needed; ``sinks[key]`` receive a storage's final value (after its last operation)."""
        sinks = sinks or {}
        events: dict[int, list[tuple[int, bool]]] = {}
        for j, op in enumerate(self.ops):
            for k in op.creates | op.defines:
                events.setdefault(k, []).append((j, True))
            for k in op.reads - op.creates - op.defines:
                events.setdefault(k, []).append((j, False))
        free_after: dict[int, list[int]] = {}
        for k, seq in events.items():
            for i, (j, _) in enumerate(seq):
                if i + 1 == len(seq) or seq[i + 1][1]:  # the value is dead after j (overwritten next, or unused)
                    free_after.setdefault(j, []).append(k)
        buffers: dict[int, torch.UntypedStorage] = {}
        default_dtype = torch.get_default_dtype()
        try:
            with torch.no_grad():
                for j, op in enumerate(self.ops):
                    for k in op.defines | op.reads:
                        if k not in buffers:  # overwritten whole, or read before any write (uninitialised, as built)
                            buffers[k] = torch.UntypedStorage(self.nbytes[k], device=self.device)
                    self._note_generators(op)
                    if op.rng is not None:
                        torch.set_rng_state(op.rng)
                    args, kwargs = tree_map(lambda v: self._real(v, buffers), (op.args, op.kwargs))
                    torch.set_default_dtype(op.dtype)
                    out = op.func(*args, **kwargs)
                    real_outs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
                    for ref, t in zip(op.outs, real_outs):
                        if ref is not None and ref.key in op.creates:
                            buffers[ref.key] = t.untyped_storage()
                    for k in free_after.get(j, ()):
                        if k in sinks and events[k][-1][0] == j:
                            for sink in sinks[k]:
                                sink(buffers[k])
                        buffers.pop(k, None)
        finally:
            torch.set_default_dtype(default_dtype)

    def _real(self, value: Any, buffers: Mapping[int, torch.UntypedStorage]) -> Any:
        if isinstance(value, _Ref):
            return value.on(buffers[value.key], self.device)
        if isinstance(value, torch.device) and value.type == "meta":
            return self.device
        return value

    def _note_generators(self, op: _Op) -> None:
        for v in tree_leaves((op.args, op.kwargs)):
            if isinstance(v, torch.Generator) and id(v) not in self.generators:
                self.generators[id(v)] = (v, v.get_state())

    @contextlib.contextmanager
    def from_the_start(self) -> Iterator[None]:
        """Generators as they were when the construction started (restored afterwards)."""
        saved = [(g, g.get_state()) for g, _ in self.generators.values()]
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self.rng)
            for g, state in self.generators.values():
                g.set_state(state)
            try:
                yield
            finally:
                for g, state in saved:
                    g.set_state(state)


def _written(func: Any, args: tuple, kwargs: dict) -> list[Tensor]:
    out = []
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, Tensor):
                out.append(v)
    return out


def _encode(value: Any) -> Any:
    if isinstance(value, Tensor):
        return _Ref.of(value) if value.is_meta else value.detach().clone()  # a constant, as it is now
    return value


class _MetaFactories(TorchFunctionMode):
    """Factories without a device make meta tensors (``torch.device("meta")`` as a context would, without
    making meta the default device). Tensors made from data (``torch.tensor``: small constants) stay
    real CPU tensors: libraries probe the device with ``torch.tensor([]).device`` and skip their
    initialisation on meta (transformers does), and a constant costs nothing to keep."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func not in _FROM_DATA and func in _device_constructors() and kwargs.get("device") is None:
            kwargs["device"] = _META
        return func(*args, **kwargs)


_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: Recording) -> None:
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.recording.add(func, args, kwargs, out)
        return out


#: recordings whose meta tensors may still be materialised (looked up by storage)
_LIVE: list[Recording] = []


@contextlib.contextmanager
def deferred_init() -> Iterator[Recording]:
    """Build on the meta device, recording how every tensor is initialised (see the module's doc).

    The construction's draws from the CPU generator are replayed on exit, so the generator's state
    afterwards is the one an ordinary construction leaves.
    """
    recording = Recording(torch.get_rng_state(), torch.device("cpu"))
    with _MetaFactories(), _Recorder(recording):
        yield recording
    end = torch.get_rng_state() if recording.reseeded() else None  # seeded after its last draw
    recording.replay()  # advance the generators as the construction would have
    if end is not None:
        torch.set_rng_state(end)
    _LIVE.append(recording)


def tensor_refs(module: nn.Module) -> dict[str, tuple[Recording, _Ref]]:
    """Each meta parameter and buffer of ``module`` built under :func:`deferred_init`, by name, with
    its recording: taken before the module is prepared (sharding replaces the tensors, not the names)."""
    by_key = {k: r for r in _LIVE for k in r.nbytes}
    out = {}
    for name, t in _named_tensors(module):
        if t.is_meta and not isinstance(t, DTensor) and _key(t) in by_key:
            out[name] = (by_key[_key(t)], _Ref.of(t))
    return out


def materialize(
    module: nn.Module,
    refs: Mapping[str, tuple[Recording, _Ref]],
    device: torch.device,
    held: Callable[[str], bool] = lambda name: True,
) -> int:
    """Allocate the meta tensors of ``module`` named in ``refs`` that ``held`` keeps (a DTensor's local
    shard only) on ``device`` and give them their recorded values; return how many. The others stay
    on the meta device. Collective-free: each rank cuts its own piece."""
    sinks: dict[Recording, dict[int, list[Callable[[torch.UntypedStorage], None]]]] = {}
    count = 0
    for name, t in _named_tensors(module):
        if name not in refs or not t.is_meta or not held(name):
            continue
        owner, attr = _owner(module, name)
        dest = _allocate(owner, attr, t, device)
        recording, ref = refs[name]
        sinks.setdefault(recording, {}).setdefault(ref.key, []).append(_sink(dest, ref, recording.device))
        count += 1
    for recording, per_key in sinks.items():
        with recording.from_the_start():
            recording.replay(per_key)
    return count


def allocate(module: nn.Module, device: torch.device, held: Callable[[str], bool] = lambda name: True) -> int:
    """Allocate, uninitialised, the meta tensors of ``module`` that ``held`` keeps (a DTensor's local
    shard only) on ``device``; return how many. For a module whose every value a checkpoint load
    sets next (a re-planned job's module, rebuilt on the meta device)."""
    count = 0
    for name, t in list(_named_tensors(module)):
        if t.is_meta and held(name):
            owner, attr = _owner(module, name)
            _allocate(owner, attr, t, device)
            count += 1
    return count


def release(refs: Mapping[str, tuple[Recording, _Ref]]) -> None:
    """Drop the recordings ``refs`` came from (their constants and meta tensors): materialised once."""
    used = {id(recording) for recording, _ in refs.values()}
    _LIVE[:] = [r for r in _LIVE if id(r) not in used]


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def _allocate(owner: nn.Module, attr: str, t: Tensor, device: torch.device) -> Tensor:
    """A real tensor like ``t`` (a DTensor: its local shard) put in ``t``'s place on ``owner``."""
    if isinstance(t, DTensor):
        local = torch.empty(t.to_local().shape, dtype=t.dtype, device=device)
        new = DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    else:
        new = torch.empty(t.shape, dtype=t.dtype, device=device)
    if attr in owner._parameters:
        param = nn.Parameter(new, requires_grad=t.requires_grad)
        owner._parameters[attr] = param
        return param
    owner._buffers[attr] = new
    return new


def _sink(dest: Tensor, ref: _Ref, device: torch.device) -> Callable[[torch.UntypedStorage], None]:
    def write(storage: torch.UntypedStorage) -> None:
        full = ref.on(storage, device)
        if isinstance(dest, DTensor):
            piece = distribute_tensor(full, dest.device_mesh, dest.placements, src_data_rank=None)
            dest.to_local().copy_(piece.to_local())
        else:
            dest.copy_(full)

    return write


__all__ = ["Recording", "allocate", "deferred_init", "materialize", "release", "tensor_refs"]
