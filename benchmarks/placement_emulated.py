"""Placement measured, not only predicted: two emulated nodes joined by a slow link.

Two "nodes" are two network namespaces on this machine joined by a veth pair whose egress is
shaped with ``tc`` on both ends (``tbf`` at ``--rate-mbit``; ``--delay-ms`` puts a ``netem`` delay
in front where the kernel has netem). Inside a namespace, ranks talk over loopback (fast, as
NVLink is inside a node); between the namespaces every byte crosses the shaped link (the network).
Each namespace's processes run on their own half of the cores (``--no-pin`` lifts that), so a
node's ranks share that node's cores, as the cost model assumes, and not the other node's.

The same plan, 4 CPU ranks (gloo) on 2 nodes of 2, an image tower on 2 ranks (data parallel: its
gradient all-reduce is the heavy traffic) and a text tower with a fifth of its parameters but as
much compute on the other 2, runs under two placements:

* **planner**: :func:`lightning_distmm.planner.place` (``hetero``), every candidate priced by the
  cost model on the emulated cluster: each tower's data-parallel group inside one node;
* **naive**: ranks dealt round-robin over the towers, as a node-unaware scheduler would: each
  tower's group spans both nodes and its gradient all-reduce crosses the link.

Each round is one multi-node launch, one ``torchrun --nnodes 2 --nproc-per-node 2`` per namespace
(``ip netns exec``, c10d rendezvous on the first namespace's veth address, gloo on the veth:
``GLOO_SOCKET_IFNAME``), whose ranks train the plan under both placements in turn, the order
alternating over ``--rounds`` rounds (the host is
shared: noise hits both alike, and the cores other processes kept busy meanwhile are printed); the
step time is rank 0's (``on_train_batch_start`` -> ``on_train_batch_end``), warm-up steps skipped,
the median over all rounds. Rank 0 is an image replica in both placements; its step is also split
into forward + backward and batch-sync (the runtime's instruction trace) and the rest (gradient
sum, optimizer, framework), next to the cost model's parts.

The prediction is :func:`lightning_distmm.planner.price_plan` of both plans on a cluster spec whose
inter-node link is the tc settings (:func:`emulated_cluster`: bandwidth = the tbf rate, TCP/IP
framing as its efficiency, latency = the measured gloo latency plus the netem delay), on this host
calibrated as ``benchmarks/cost_model_fidelity.py`` does: ``measure_local_cpu`` (matmul table,
gloo over loopback), ``Device.concurrency`` of a node's two ranks on its cores
(``ConcurrencyProbe``), each tower's forward/backward fit and AdamW step (``measure_tower``).

Needs root, ``ip netns`` (iproute2) and ``tc`` with ``tbf``. The namespaces, the veth pair and its
qdiscs are removed in ``finally`` (Ctrl-C and SIGTERM included); leftovers of a crashed run
(namespaces ``ldmpe<pid>a`` / ``ldmpe<pid>b`` whose pid is gone) are removed at start. About 3.5
minutes with the defaults on the (shared) 2-core development VM.

    python benchmarks/placement_emulated.py [--rate-mbit 200] [--rounds 3] [--steps 8] [--model small|tiny] [-v]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package, whatever is installed
sys.path.insert(1, str(Path(__file__).resolve().parent))  # benchmarks/: cost_model_fidelity, synthetic

from lightning_distmm.faults import pid_alive  # noqa: E402
from lightning_distmm.planner import Cluster, Link, Plan, PlannerOptions, place, price_plan  # noqa: E402

PREFIX = "ldmpe"  # namespaces ldmpe<pid>a and ldmpe<pid>b; each veth end is named like its namespace
ADDRS = ("10.213.0.1", "10.213.0.2")  # exist only inside the two namespaces
PORT = 29400  # rendezvous port inside the first namespace, + the run's index (never reused)
NODES, DEVICES_PER_NODE = 2, 2
OPTIM = {"scheduler": "constant", "warmup_steps": 0, "lr": 1e-4}
# what the runtime executes (the options DistMMStrategy(plan="auto") prices with)
PLANNER_OPTIONS = {"max_tp": 1, "max_pp": 1, "schedules": ["gpipe"], "recompute": False}
PLACEMENTS = ("planner", "naive")

# "small": a ViT image tower of 1.8M parameters (7.3 MB of fp32 gradients to all-reduce every step)
# beside a text tower of 0.37M whose long captions (192 tokens) make its forward and backward about
# as long as the image tower's: the image tower's data-parallel group is the heavy traffic, and both
# placements load each node's cores alike (two image replicas on one node and two text replicas on
# the other, or one of each on both), so the step times differ by what crosses the link.
SMALL: dict[str, Any] = {
    "name": "clip_small_heavy_image",
    "embed_dim": 64,
    "init_logit_scale": 2.659,
    "towers": {
        "image": {
            "arch": "vit",
            "input": "image",
            "img_size": 32,
            "patch_size": 4,
            "width": 192,
            "layers": 4,
            "heads": 3,
            "mlp_ratio": 4.0,
        },
        "text": {
            "arch": "clip_text",
            "input": ["input_ids", "attention_mask"],
            "vocab_size": 64,
            "context_length": 192,
            "width": 96,
            "layers": 3,
            "heads": 2,
            "mlp_ratio": 4.0,
        },
    },
}


def model_config(name: str) -> dict[str, Any]:
    """``small``, ``tiny`` or the path of a JSON model config (a sibling benchmark's own model)."""
    if name == "tiny":
        from lightning_distmm.models.clip import CLIP_TINY

        return CLIP_TINY
    if name == "small":
        return SMALL
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"--model {name!r}: expected small, tiny or a JSON model config file")
    return json.loads(path.read_text())


# ---------------------------------------------------------------------- the link and its spec
@dataclasses.dataclass(frozen=True)
class LinkSettings:
    """The emulated network between the two nodes: each veth end's egress (one node's NIC, one
    direction) limited to ``rate_mbit`` by ``tbf``, after a ``netem`` delay of ``delay_ms``."""

    rate_mbit: float = 200.0
    delay_ms: float = 0.0
    queue_ms: float = 200.0  # tbf's queue bound: room for a gradient bucket's burst without drops
    mtu: int = 1500

    @property
    def rate_bytes(self) -> float:
        return self.rate_mbit * 1e6 / 8

    burst_kib: float | None = None  # tbf's bucket; None: :attr:`burst_bytes`'s default

    @property
    def burst_bytes(self) -> int:
        """tbf's bucket: ``burst_kib``, else a quarter millisecond of the rate; never below a 64 KiB
        segment (veth GSO).

        A NIC sends at its line rate and banks nothing while idle; tbf lets a whole bucket pass at
        once after an idle spell, so a collective that follows a stretch of compute gets the bucket
        free. A bucket of one jiffy of the rate (HZ 250, tc's old rule for timer-driven shaping),
        this emulation's earlier setting, gave every such collective 4 ms: at 459 Mbit/s FSDP's
        per-block gather of the image tower took 24 ms alone, 21 ms after compute (26 priced), and
        with a 64 KiB bucket 30 and 26 ms (``collectives_emulated.py --burst-kib 64``). The bucket
        is the smallest that holds the rate: one TCP stream through 4,330 Mbit/s reached 0.92 of it
        with 64 KiB and 0.955-0.96 (the payload share of a frame) with 128 KiB to 2 MiB; 0.96 at 433
        Mbit/s with any of them."""
        if self.burst_kib is not None:
            return int(max(64 * 1024, self.burst_kib * 1024))
        return int(max(64 * 1024, self.rate_bytes * 0.25e-3))

    @property
    def tcp_efficiency(self) -> float:
        """Payload share of a full frame, which tbf counts whole: TCP payload (MTU - 20 IP - 32 TCP
        with timestamps) over the frame (MTU + 14 Ethernet)."""
        return round((self.mtu - 52) / (self.mtu + 14), 4)

    def tc_commands(self, dev: str) -> list[list[str]]:
        """The ``tc`` invocations (run inside the device's namespace) that shape ``dev``'s egress."""
        tbf = ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", str(self.burst_bytes), "latency"]
        tbf.append(f"{self.queue_ms:g}ms")
        if self.delay_ms <= 0:
            return [["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", *tbf]]
        return [
            ["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "netem", "delay", f"{self.delay_ms:g}ms"],
            ["tc", "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "10:", *tbf],
        ]


def emulated_cluster(host: Cluster, link: LinkSettings, concurrency: float | None = None) -> Cluster:
    """The cluster the two namespaces emulate: ``NODES`` nodes of ``DEVICES_PER_NODE`` devices of
    ``host`` (this machine measured by ``measure_local_cpu``: its devices, and loopback gloo as the
    link inside a node), joined by the shaped veth: bandwidth the tbf rate (per node and direction,
    as ``Cluster.inter`` is), efficiency the TCP/IP framing tbf also counts, latency the measured
    gloo step latency plus the netem delay."""
    device = host.device if concurrency is None else dataclasses.replace(host.device, concurrency=concurrency)
    inter = Link(
        bandwidth=link.rate_bytes,
        latency=host.intra.latency + link.delay_ms * 1e-3,
        efficiency=link.tcp_efficiency,
    )
    return dataclasses.replace(
        host,
        name=f"emulated_{link.rate_mbit:g}mbit",
        nodes=NODES,
        devices_per_node=DEVICES_PER_NODE,
        device=device,
        inter=inter,
        notes=f"{host.name} as {NODES} network namespaces of {DEVICES_PER_NODE}, veth shaped to {link.rate_mbit:g}"
        f" Mbit/s (tbf) + {link.delay_ms:g} ms (netem)",
    )


# ---------------------------------------------------------------------- the two placements
Layout = dict[str, list[int]]


def planner_layout(
    sizes: Mapping[str, int], cluster: Cluster, score: Callable[[Layout], float] | None = None
) -> Layout:
    """The planner's node-aware placement (``hetero``) of towers of ``sizes`` devices (tp 1)."""
    layout, _ = place(sizes, {n: 1 for n in sizes}, cluster, "hetero", score)
    return {n: list(r) for n, r in layout.items()}


def naive_layout(sizes: Mapping[str, int]) -> Layout:
    """Ranks dealt round-robin over the towers (rank r to the next tower that still needs one), as
    a scheduler that ignores nodes would: each tower's ranks alternate, so its group spans nodes."""
    out: Layout = {n: [] for n in sizes}
    names = list(sizes)
    rank, i = 0, 0
    while rank < sum(sizes.values()):
        name = names[i % len(names)]
        if len(out[name]) < sizes[name]:
            out[name].append(rank)
            rank += 1
        i += 1
    return out


def nodes_of(ranks: Sequence[int], devices_per_node: int = DEVICES_PER_NODE) -> list[int]:
    return sorted({r // devices_per_node for r in ranks})


def to_plan(layout: Layout, batch: int) -> Plan:
    return Plan(NODES * DEVICES_PER_NODE, {n: {"ranks": list(r)} for n, r in layout.items()}, global_batch=batch)


def describe(layout: Layout) -> str:
    return " | ".join(
        f"{n}@{','.join(map(str, r))} (node{'s' if len(nodes_of(r)) > 1 else ''} {','.join(map(str, nodes_of(r)))})"
        for n, r in layout.items()
    )


# ---------------------------------------------------------------------- the namespaces
def leftover_namespaces(listing: str, alive: Callable[[int], bool] = pid_alive) -> list[str]:
    """Namespaces of ``ip netns list`` output left by runs of this benchmark that are gone."""
    out = []
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)[ab]", name)
        if m and not alive(int(m.group(1))):
            out.append(name)
    return out


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


class Emulation:
    """Two namespaces joined by a shaped veth pair; a context manager that always tears down."""

    def __init__(self, link: LinkSettings, tag: str | None = None) -> None:
        self.link = link
        tag = tag or str(os.getpid())
        self.ns = (f"{PREFIX}{tag}a", f"{PREFIX}{tag}b")
        self.dev = self.ns  # the veth end inside each namespace is named like it (<= 15 characters)

    def __enter__(self) -> Emulation:
        self.clean_leftovers()
        try:
            self.setup()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    @staticmethod
    def clean_leftovers() -> list[str]:
        listing = _ip("netns", "list", check=False).stdout
        gone = leftover_namespaces(listing)
        for ns in gone:
            _remove_namespace(ns)
        return gone

    def setup(self) -> None:
        a, b = self.ns
        for ns in self.ns:
            _ip("netns", "add", ns)
        # both ends created inside their namespaces: nothing lands in the host's namespace
        _ip("link", "add", self.dev[0], "netns", a, "type", "veth", "peer", "name", self.dev[1], "netns", b)
        for ns, dev, addr in zip(self.ns, self.dev, ADDRS, strict=True):
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "mtu", str(self.link.mtu), "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        self.set_link(self.link)

    def set_link(self, link: LinkSettings) -> None:
        """Shape both ends of the veth as ``link`` says (``tc qdisc replace``: also on a live link,
        so that runs at several rates can alternate on one emulation)."""
        for ns, dev in zip(self.ns, self.dev, strict=True):
            for cmd in link.tc_commands(dev):
                done = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True)
                if done.returncode:
                    kind = "netem (--delay-ms)" if "netem" in cmd else "tbf"
                    raise RuntimeError(
                        f"tc refused {' '.join(cmd)!r}: {done.stderr.strip()} (this kernel lacks the {kind} qdisc?)"
                    )
        self.link = link

    def teardown(self) -> None:
        for ns in self.ns:
            _remove_namespace(ns)

    def exec(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[node]]

    def qdisc_stats(self) -> str:
        return "\n".join(
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "-s", "qdisc", "show", "dev", dev], capture_output=True, text=True
            ).stdout.strip()
            for ns, dev in zip(self.ns, self.dev, strict=True)
        )


def _remove_namespace(ns: str) -> None:
    """Kill what still runs inside ``ns`` (processes this benchmark started there) and delete it
    (its veth end, the peer and their qdiscs go with it)."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    for _ in range(50):
        if not _ip("netns", "pids", ns, check=False).stdout.split():
            break
        time.sleep(0.1)
    _ip("netns", "del", ns, check=False)


PROBE = r"""
import socket, sys, time
role, addr, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "server":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((addr, 5201)); s.listen(1)
    print("ready", flush=True)
    c, _ = s.accept(); got, t0 = 0, None
    while True:
        d = c.recv(1 << 20)
        if not d: break
        t0 = t0 or time.perf_counter(); got += len(d)
    print(got * 8 / (time.perf_counter() - t0) / 1e6, flush=True)
else:
    c = socket.create_connection((addr, 5201)); buf = b"x" * nbytes
    c.sendall(b"x" * 65536); c.sendall(buf); c.close()
"""


def probe_link(emu: Emulation, seconds: float = 0.5) -> float:
    """Mbit/s of one TCP stream from the first namespace to the second (the shaped link)."""
    nbytes = int(max(2**20, emu.link.rate_bytes * seconds))
    server = subprocess.Popen(
        [*emu.exec(1), sys.executable, "-c", PROBE, "server", ADDRS[1], "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("link probe server did not start")
        subprocess.run(
            [*emu.exec(0), sys.executable, "-c", PROBE, "client", ADDRS[1], str(nbytes)], check=True, timeout=60
        )
        return float(server.stdout.readline())
    finally:
        if server.poll() is None:
            server.kill()
        server.wait()


# ---------------------------------------------------------------------- one launch
def node_cores(pin: bool) -> list[set[int]]:
    """The cores each node's processes may use: halves of this process's cores (all of them for
    each node when not pinning or with a single core)."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < NODES:
        return [set(cores)] * NODES
    k = len(cores) // NODES
    return [set(cores[i * k : (i + 1) * k]) for i in range(NODES)]


def threads_per_rank(cores: set[int]) -> int:
    return max(1, len(cores) // DEVICES_PER_NODE)


def node_launch(
    emu: Emulation, node: int, port: int, rdzv_id: str, worker: list[str], cores: list[set[int]]
) -> tuple[list[str], dict[str, str]]:
    """The command and environment of one namespace's ``torchrun`` running ``worker`` (a script and
    its arguments; ``--threads`` is added): its 2 ranks on the namespace's veth, the rendezvous on
    the first namespace at ``port``, the launcher's own variables from outside left out."""
    threads = str(threads_per_rank(cores[node]))
    cmd = [*emu.exec(node), sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES)]
    cmd += ["--nproc-per-node", str(DEVICES_PER_NODE), "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", f"{ADDRS[0]}:{port}", "--rdzv-id", rdzv_id]
    cmd += ["--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", ADDRS[node], "--max-restarts", "0"]
    cmd += [*worker, "--threads", threads]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PL_", "MASTER_"))}
    env.update(
        PYTHONPATH=f"{ROOT}:{env.get('PYTHONPATH', '')}",
        GLOO_SOCKET_IFNAME=emu.dev[node],
        OMP_NUM_THREADS=threads,
        PYTHONWARNINGS="ignore",
        LDM_EMULATED_NODE=str(node),
    )
    return cmd, env


def run_round(
    emu: Emulation, plans: Mapping[str, Plan], args: argparse.Namespace, tmp: Path, run: int, cores: list[set[int]]
) -> dict[str, Any]:
    """One multi-node launch (a torchrun per namespace) whose ranks fit each of ``plans`` in turn;
    rank 0's timed steps per plan and every rank's namespace."""
    out = tmp / f"run{run}"
    out.mkdir()
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for node in range(NODES):
            worker = [str(Path(__file__).resolve()), "--worker", "--out", str(out), "--model", args.model]
            worker += ["--batch", str(args.batch), "--steps", str(args.steps)]
            for label, plan in plans.items():
                plan_path = out / f"{label}.yaml"
                plan.to_yaml(plan_path)
                worker += ["--plan", f"{label}={plan_path}"]
            cmd, env = node_launch(emu, node, PORT + run, f"{emu.ns[0]}-{run}", worker, cores)
            log = open(out / f"node{node}.log", "w")  # noqa: SIM115 - closed in finally
            logs.append(log)
            affinity = cores[node]
            procs.append(
                subprocess.Popen(
                    cmd,
                    env=env,
                    cwd=ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=lambda a=affinity: os.sched_setaffinity(0, a),  # noqa: PLW1509
                )
            )
        deadline = time.monotonic() + args.run_timeout
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                time.sleep(5 if failed else 0)  # let the other node report its side
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            _stop(p)
        for log in logs:
            log.close()
    if any(p.returncode for p in procs):
        tails = "\n".join(
            f"--- node {i} (exit {p.returncode}):\n{(out / f'node{i}.log').read_text()[-3000:]}"
            for i, p in enumerate(procs)
        )
        raise RuntimeError(f"launch {run} failed:\n{tails}")
    ranks = {}
    for f in out.glob("rank*.json"):
        d = json.loads(f.read_text())
        ranks[int(d["rank"])] = d
    return {
        "rank0": {label: ranks[0]["runs"][label][args.warmup :] for label in plans},
        "nodes": [ranks[r]["node"] for r in sorted(ranks)],
        # per rank, medians over the timed steps: wall, CPU, forward, backward, batch-sync seconds and
        # the seconds in collectives within the forward, within the backward and elsewhere
        "parts": {
            label: [[statistics.median(c) for c in zip(*ranks[r]["runs"][label][args.warmup :])] for r in sorted(ranks)]
            for label in plans
        },
    }


def _stop(p: subprocess.Popen) -> None:
    if p.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------------- a rank (under torchrun)
def worker(args: argparse.Namespace) -> None:
    """A rank under torchrun: fits the model under each ``--plan`` in turn (one process group)."""
    import lightning as L
    import torch
    from collective_clock import CollectiveClock
    from cost_model_fidelity import Pairs
    from torch.utils.data import DataLoader

    import lightning_distmm as ldm
    from lightning_distmm.models.clip import CLIPModel

    clock = CollectiveClock()
    clock.install()
    torch.set_num_threads(args.threads)
    rank = int(os.environ["RANK"])
    out = Path(args.out) / f"rank{rank}.json"
    node = int(os.environ.get("LDM_EMULATED_NODE", -1))
    record: dict[str, Any] = {"rank": rank, "node": node, "runs": {}}

    class StepTimer(L.Callback):
        """Per step: wall seconds, the CPU seconds of this rank's process, the seconds its
        instructions took (forward, backward, batch-sync: the runtime's trace) and the seconds it
        spent blocked in collectives inside its forward, inside its backward and elsewhere
        (:class:`collective_clock.CollectiveClock`)."""

        def __init__(self, rows: list[list[float]]) -> None:
            self.rows, self.t0, self.c0 = rows, 0.0, 0.0

        def on_train_start(self, trainer, pl_module):
            trainer.strategy.engine.record_trace(True)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            clock.take()
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            wall, cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
            parts = dict.fromkeys(("Forward", "Backward", "BatchSync"), 0.0)
            spans = [(type(ins).__name__, start, end) for ins, start, end in trainer.strategy.engine.step.trace]
            for kind, start, end in spans:
                if kind in parts:
                    parts[kind] += end - start
            waits = CollectiveClock.split(clock.take(), [s for s in spans if s[0] in ("Forward", "Backward")])
            coll = [waits.get("Forward", 0.0), waits.get("Backward", 0.0), waits["other"]]
            self.rows.append([wall, cpu, *parts.values(), *coll])

    model = model_config(args.model)
    img, ctx = model["towers"]["image"]["img_size"], model["towers"]["text"]["context_length"]
    for item in args.plan:
        label, path = item.split("=", 1)
        L.seed_everything(0, verbose=False)
        module = CLIPModel(model, OPTIM)
        data = DataLoader(
            Pairs(args.batch * args.steps, img, ctx), batch_size=args.batch, shuffle=False, drop_last=True
        )
        rows = record["runs"][label] = []
        trainer = L.Trainer(
            accelerator="cpu",
            num_nodes=NODES,
            devices=DEVICES_PER_NODE,
            strategy=ldm.DistMMStrategy(plan=path),
            max_steps=args.steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            callbacks=[StepTimer(rows)],
        )
        trainer.fit(module, data)
        out.write_text(json.dumps(record))


# ---------------------------------------------------------------------- the prediction
def calibrate(
    model: dict[str, Any], args: argparse.Namespace, cores: set[int], analytic: bool = False
) -> tuple[Cluster, float, dict]:
    """This host as one node sees it (``cores``): measured devices and loopback gloo, the two ranks'
    concurrency on the node's cores, each tower's measured profile. With ``--cached-host`` the
    devices and gloo come from ``measure_local_cpu``'s per-host cache (measured unpinned, as
    ``plan="auto"`` measures them, so that the cache holds what it always holds). With
    ``analytic`` each measured fit rides on the tower's analytic profile, so that tp/pp splits
    (and their all-reduces) can be priced too, and carries the runtime's own work per layer: under
    tp 2 and FSDP2 timed on a pair of ranks sharing the node's cores (:func:`pair_times`,
    :func:`peer_work`)."""

    from lightning_distmm.planner import (
        ConcurrencyProbe,
        measure_local_cpu,
    )

    if args.cached_host:
        host = measure_local_cpu(devices=DEVICES_PER_NODE, measure_concurrency=False)
    with pinned(cores):  # the probes' processes inherit it
        if not args.cached_host:
            host = measure_local_cpu(devices=DEVICES_PER_NODE, cache=False, measure_concurrency=False)
        with ConcurrencyProbe(DEVICES_PER_NODE, threads_per_rank(cores)) as probe:
            # side_by_side_emulated's arguments have no --concurrency-rounds: the probe's default there
            concurrency = probe.measure(rounds=getattr(args, "concurrency_rounds", 3))
        profiles = tower_profiles(model, args, analytic)
        if analytic:  # the runtime's own work per layer under tp 2 and FSDP2, timed on a node's pair of ranks
            node = emulated_cluster(host, LinkSettings(), concurrency)
            opts = PlannerOptions.from_any(planner_options(0.0)).cost
            repeats = max(args.profile_repeats, PAIR_REPEATS)
            for kind, by_tower in pair_times(model, cores, PAIR_BATCHES, repeats).items():
                for name, times in by_tower.items():
                    work = peer_work(kind, profiles[name], node, opts, times)
                    step = peer_optimizer_work(kind, profiles[name], node, opts, times["optimizer"])
                    profiles[name].measured.runtime_overhead[kind] = work
                    profiles[name].measured.optimizer_overhead[kind] = step
                    print(
                        f"{kind} pair on one node's cores, {name}: forward / backward "
                        + ", ".join(f"{f * 1e3:.0f} / {w * 1e3:.0f} ms at {b} rows" for b, (f, w) in sorted((b, v) for b, v in times.items() if b != "optimizer"))
                        + f"; beyond the priced compute and {kind} collectives: "
                        + " / ".join(f"{a * 1e3:.1f} + {k * 1e3:.2f} per row ms" for a, k in work)
                        + f"; AdamW step {times['optimizer'] * 1e3:.1f} ms, {step * 1e3:.1f} beyond a plain one",
                        flush=True,
                    )  # fmt: skip
    return host, concurrency, profiles


@contextlib.contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """This process (and what it starts) on ``cores`` with a node's rank's torch threads, as a
    node's ranks run; the affinity and threads restored after."""
    import torch

    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(threads_per_rank(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
        torch.set_num_threads(threads)


def tower_profiles(model: dict[str, Any], args: argparse.Namespace, analytic: bool = False) -> dict[str, Any]:
    """Each tower of ``model`` timed here (``measure_tower`` at ``--profile-batches``), as a measured
    profile; with ``analytic`` riding on the tower's analytic profile."""
    import torch
    from cost_model_fidelity import example_inputs

    from lightning_distmm.models.clip import CLIPModel
    from lightning_distmm.planner import measure_tower, measured_profile, model_profiles

    torch.manual_seed(0)
    inputs = example_inputs(model)
    return {
        name: measured_profile(
            name,
            measure_tower(t.module, inputs[name], args.profile_batches, "cpu", repeats=args.profile_repeats),
            False,
            int(model["embed_dim"]),
            model_profiles(model)[name] if analytic else None,
        )
        for name, t in CLIPModel(model, OPTIM).towers().items()
    }


#: the runtime's layer-wise forms a pair of ranks is timed under: ``MeasuredFit.runtime_overhead`` keys
PAIR_KINDS = ("tp", "fsdp")
#: rows a pair is timed at, and passes per size (the median is kept: see :func:`pair_times`)
PAIR_BATCHES = (4, 8, 16)
PAIR_REPEATS = 5


def pair_times(
    model: dict[str, Any], cores: set[int], batches: Sequence[int], repeats: int
) -> dict[str, dict[str, dict[int, tuple[float, float]]]]:
    """Each tower's forward and backward seconds under tensor parallelism 2 (the runtime's
    ``apply_tp``) and under FSDP2 over two ranks (``apply_fsdp``), on two processes pinned to
    ``cores`` (one node's, shared as the node's two ranks share them in training), joined by
    loopback gloo: per form, tower and batch, the median of ``repeats`` passes on rank 0, both
    ranks starting each pass together, and (key ``"optimizer"``) the median AdamW step over the
    wrapped parameters.

    The median, not the fastest pass as for one rank's profile: how long a pair waits for its
    shared core after each collective varies from pass to pass, and training meets that variation
    in every step (the side-by-side reports median steps). Timed as the fastest of 3 passes at 8
    and 16 rows, what the pair took beyond its price moved by 2-3x between calibrations (the image
    tower's tp forward: 7 to 23 ms), and the Megatron-style plan's price with it (-7% to +15% on the
    fast link).

    Each process runs in its own session, as torchrun starts ranks: where the kernel groups tasks
    by session for scheduling (autogroup), a rank woken by a finished collective then waits for its
    core longer than a child of the same session would. Measured: the tp pair's forward and
    backward took 60 / 103 ms (image tower, 16 rows) in one session and 75 / 134 ms in two, the
    latter what the tp 2 plan's ranks take in training under torchrun."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="pair_") as tmp:
        out = Path(tmp) / "times.json"
        args = (model, tmp, sorted(cores), threads_per_rank(cores), list(batches), repeats, str(out))
        mp.start_processes(_pair_rank, args=args, nprocs=2, start_method="spawn")
        data = json.loads(out.read_text())
    return {
        kind: {
            name: {k if k == "optimizer" else int(k): v if k == "optimizer" else tuple(v) for k, v in times.items()}
            for name, times in towers.items()
        }
        for kind, towers in data.items()
    }


def _pair_rank(
    rank: int, model: dict, tmp: str, cores: list[int], threads: int, batches: list[int], repeats: int, out: str
) -> None:
    """One rank of :func:`pair_times`."""
    import torch
    import torch.distributed as dist
    from cost_model_fidelity import example_inputs
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_distmm.models.clip import CLIPModel
    from lightning_distmm.parallel.families import apply_tp
    from lightning_distmm.parallel.fsdp import apply_fsdp
    from lightning_distmm.planner.measure.tower_timing import forward_backward_seconds

    os.setsid()  # its own session, as torchrun starts each rank
    os.sched_setaffinity(0, set(cores))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        inputs = example_inputs(model)
        wrap = {"tp": lambda m: apply_tp(m, mesh), "fsdp": lambda m: apply_fsdp(m, mesh)}
        times: dict[str, dict[str, dict[int, list[float]]]] = {}
        for kind in PAIR_KINDS:
            torch.manual_seed(0)
            for name, t in CLIPModel(model, OPTIM).towers().items():
                module = wrap[kind](t.module)
                for b in batches:
                    torch.manual_seed(b)  # the same rows on both ranks
                    x = list(inputs[name](b))
                    passes = []
                    for i in range(1 + repeats):  # the first pass warms up
                        dist.barrier()
                        fwd, bwd = forward_backward_seconds(module, x)
                        if i:
                            passes.append((fwd, bwd))
                    typical = [statistics.median(p[part] for p in passes) for part in (0, 1)]
                    times.setdefault(kind, {}).setdefault(name, {})[str(b)] = typical
                # an AdamW step over the wrapped parameters (their gradients from the last pass)
                opt = torch.optim.AdamW([q for q in module.parameters() if q.requires_grad], lr=1e-6)
                steps = []
                for i in range(1 + repeats):  # the first step creates the moments
                    dist.barrier()
                    t0 = time.perf_counter()
                    opt.step()
                    if i:
                        steps.append(time.perf_counter() - t0)
                times[kind][name]["optimizer"] = statistics.median(steps)
        if rank == 0:
            Path(out).write_text(json.dumps(times))
    finally:
        dist.destroy_process_group()


def peer_work(
    kind: str, profile: Any, node: Cluster, opts: Any, times: Mapping[int, tuple[float, float]]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """``MeasuredFit.runtime_overhead[kind]`` from :func:`pair_times`: what a pair's forward and
    backward take beyond what the cost model prices for them on ``node`` (``"tp"``: the tp 2
    stage's compute and its all-reduces; ``"fsdp"``: the whole tower's compute and a 2-rank
    shard group's per-layer gathers and reduce-scatters), with the node's two busy ranks'
    stretch taken out, as ``a + k * rows`` (fitted through the batches timed, never below 0): the
    runtime's per-layer work with a peer (DTensor's redistribution, FSDP2's hooks, each
    collective's wait for its rank's next turn on a shared core), which FLOPs and bytes do not
    price."""
    import numpy as np

    from lightning_distmm.planner.cost import shard_comm, stage_compute, tp_comm

    xs = np.asarray(sorted(b for b in times if b != "optimizer"), dtype=float)
    if kind == "tp":
        fc, bc = (np.atleast_1d(v) for v in stage_compute(profile, node, opts, xs, 2, 1))
        tpc = np.atleast_1d(tp_comm(profile, node, opts, xs, 2, 1))
        priced = (fc + tpc, bc + tpc)
    elif kind == "fsdp":
        fc, bc = (np.atleast_1d(v) for v in stage_compute(profile, node, opts, xs, 1, 1))
        ag, agrs = (float(v) for v in shard_comm(profile, node, opts, 2, 1, 1, "full"))
        priced = (fc + ag, bc + agrs)
    else:
        raise ValueError(f"no pair measurement of {kind!r}: one of {PAIR_KINDS}")
    stretch = max(1.0, node.device.concurrency)
    out = []
    for part in (0, 1):
        extra = np.maximum(np.asarray([times[int(b)][part] for b in xs]) / stretch - priced[part], 0.0)
        k = float(np.polyfit(xs, extra, 1)[0]) if len(xs) > 1 else 0.0
        a = float(np.mean(extra - k * xs))
        if a < 0:  # through the origin
            a, k = 0.0, float(np.mean(extra / xs))
        out.append((a, max(k, 0.0)))
    return out[0], out[1]


def peer_optimizer_work(kind: str, profile: Any, node: Cluster, opts: Any, seconds: float) -> float:
    """``MeasuredFit.optimizer_overhead[kind]`` from :func:`pair_times`: what the pair's AdamW step
    over the runtime's DTensors took beyond the priced plain step of the same share of the
    parameters (``optimizer_time`` from the tower's timed plain step), never below 0."""
    from lightning_distmm.planner.cost import optimizer_time

    tp, shard = (2, "none") if kind == "tp" else (1, "full")
    plain = dataclasses.replace(profile, measured=dataclasses.replace(profile.measured, optimizer_overhead={}))
    return max(0.0, seconds - optimizer_time(plain, node, opts, tp, 1, shard, 2))


def planner_options(step_overhead: float) -> dict[str, Any]:
    from lightning_distmm.planner import runtime_cost_defaults

    return {**runtime_cost_defaults(PLANNER_OPTIONS, "cpu"), "step_overhead": step_overhead}


# ---------------------------------------------------------------------- the benchmark
def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through every finally: processes stopped, namespaces removed


def add_profile_args(parser: argparse.ArgumentParser) -> None:
    """``--profile-batches`` and ``--profile-repeats``: how :func:`tower_profiles` times each tower
    (this script's and side_by_side_emulated's)."""
    parser.add_argument(
        "--profile-batches",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        default=(1, 2, 4, 8, 16, 32),
        help="rows each tower is timed at: every microbatch the planner may pick lies between two of them",
    )
    parser.add_argument("--profile-repeats", type=int, default=3)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate-mbit", type=float, default=200.0, help="the link's rate per node and direction")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added by netem (needs netem)")
    parser.add_argument("--model", default="small", help="small, tiny or a JSON model config file")
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="rounds, each runs both placements (order alternates)")
    parser.add_argument("--step-overhead-ms", type=float, default=0.0, help="CostOptions.step_overhead to predict with")
    parser.add_argument("--no-pin", dest="pin", action="store_false", help="let both nodes use every core")
    parser.add_argument("--run-timeout", type=float, default=300.0, help="seconds one launch may take")
    add_profile_args(parser)
    parser.add_argument(
        "--concurrency-rounds", type=int, default=3, help="rounds of the two ranks' concurrency probe (median)"
    )
    parser.add_argument(
        "--cached-host",
        action="store_true",
        help="take the host's matmul and gloo numbers from measure_local_cpu's per-host cache (plan='auto''s)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="print each run's steps and the qdisc counters")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a rank under torchrun
    parser.add_argument("--plan", action="append", default=[], help=argparse.SUPPRESS)  # label=plan.yaml
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.model not in ("small", "tiny") and not Path(args.model).is_file():
        parser.error(f"--model {args.model!r}: expected small, tiny or a JSON model config file")
    if not args.worker and args.warmup >= args.steps:
        parser.error(f"--warmup {args.warmup} leaves no timed step of --steps {args.steps}")
    return args


def preflight() -> str | None:
    """Why this machine cannot run the emulation, or None."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2's ip and tc"
    if _ip("netns", "list", check=False).returncode:
        return "ip netns is unavailable"
    return None


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    why = preflight()
    if why:
        sys.exit(f"placement_emulated: {why}")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _exit_on_signal)
    import warnings

    from cost_model_fidelity import ForeignLoad

    warnings.filterwarnings("ignore")
    link = LinkSettings(args.rate_mbit, args.delay_ms)
    model = model_config(args.model)
    cores = node_cores(args.pin)
    t0 = time.perf_counter()
    host, concurrency, profiles = calibrate(model, args, cores[0])
    cluster = emulated_cluster(host, link, concurrency)
    options = planner_options(args.step_overhead_ms * 1e-3)
    sizes = {"image": 2, "text": 2}

    def score(layout: Layout) -> float:
        return price_plan(to_plan(layout, args.batch), profiles, cluster, options).step_time

    layouts = {"planner": planner_layout(sizes, cluster, score), "naive": naive_layout(sizes)}
    plans = {k: to_plan(v, args.batch) for k, v in layouts.items()}
    predicted = {k: price_plan(p, profiles, cluster, options) for k, p in plans.items()}
    print(
        f"calibrated in {time.perf_counter() - t0:.0f} s: node cores {[sorted(c) for c in cores]}, concurrency"
        f" {concurrency:.2f}, gloo over loopback {host.intra.bandwidth / 1e9:.2f} GB/s, {host.intra.latency * 1e6:.0f} us"
        " per ring step",
        flush=True,
    )
    rows: dict[str, list[list[float]]] = {k: [] for k in PLACEMENTS}  # rank 0's timed steps, all rounds
    per_round: dict[str, list[float]] = {k: [] for k in PLACEMENTS}
    foreign: list[float] = []
    with tempfile.TemporaryDirectory(prefix="placement_emulated_") as tmp, Emulation(link) as emu:
        mbit = probe_link(emu)
        print(
            f"link: {emu.ns[0]} <-> {emu.ns[1]}, tbf {link.rate_mbit:g} Mbit/s, one TCP stream measured {mbit:.0f} Mbit/s",
            flush=True,
        )
        for r in range(args.rounds):
            order = PLACEMENTS if r % 2 == 0 else PLACEMENTS[::-1]
            load = ForeignLoad()
            load.start()
            got = run_round(emu, {k: plans[k] for k in order}, args, Path(tmp), r, cores)
            foreign.append(load.stop())
            pairs = {n: sorted(i for i, x in enumerate(got["nodes"]) if x == n) for n in set(got["nodes"])}
            if sorted(pairs.values()) != [[0, 1], [2, 3]]:
                raise RuntimeError(f"ranks landed on the namespaces as {got['nodes']}, not two per node in order")
            for k in order:
                rows[k] += got["rank0"][k]
                per_round[k].append(statistics.median(row[0] for row in got["rank0"][k]))
                if args.verbose:
                    print(
                        f"  round {r + 1} {k}: steps ms "
                        + " ".join(f"{row[0] * 1e3:.0f}" for row in got["rank0"][k])
                        + "; ranks' medians ms (wall/CPU/forward/backward/batch-sync): "
                        + ", ".join("/".join(f"{x * 1e3:.0f}" for x in rank) for rank in got["parts"][k]),
                        flush=True,
                    )
            print(round_line(r, order, got["nodes"], per_round, PLACEMENTS, foreign[-1], t0), flush=True)
        if args.verbose:
            print(emu.qdisc_stats())
    report(args, link, cluster, layouts, predicted, rows, per_round, mbit, foreign)


def round_line(
    r: int, order: list[str], nodes: Any, per_round: dict[str, list[float]], names: Any, busy: float, t0: float
) -> str:
    """One round's line: the order run, the ranks' namespaces, each run's median step, the other load."""
    return (
        f"round {r + 1} ({' then '.join(order)}, ranks on namespaces {nodes}): "
        + ", ".join(f"{k} {per_round[k][-1] * 1e3:.0f} ms" for k in names)
        + f"; other processes kept {busy:.1f} cores busy ({time.perf_counter() - t0:.0f} s)"
    )


def report(args, link, cluster, layouts, predicted, rows, per_round, mbit, foreign) -> None:
    from lightning_distmm.models.clip import CLIPModel

    params = {
        n: sum(p.numel() for p in t.module.parameters())
        for n, t in CLIPModel(model_config(args.model), OPTIM).towers().items()
    }
    # rank 0 (an image replica in both layouts), medians over all timed steps: wall, CPU, forward, backward, batch-sync
    med = {k: [statistics.median(c) for c in zip(*v)] for k, v in rows.items()}
    measured = {k: med[k][0] for k in PLACEMENTS}
    print(
        f"\nplacement on emulated nodes: {NODES} network namespaces x {DEVICES_PER_NODE} CPU ranks (gloo), veth shaped"
        f" to {link.rate_mbit:g} Mbit/s per direction (tbf; {mbit:.0f} Mbit/s measured), delay {link.delay_ms:g} ms;"
        f" {model_config(args.model)['name']} (image {params['image'] / 1e6:.2f}M, text {params['text'] / 1e6:.2f}M"
        f" parameters), global batch {args.batch}; {args.rounds} rounds x {args.steps - args.warmup} timed steps;"
        f" other processes kept {statistics.median(foreign):.1f} cores busy (median over rounds)"
    )
    print(
        f"cluster spec of the prediction: inter-node {cluster.inter.bandwidth / 1e6:.1f} MB/s x efficiency"
        f" {cluster.inter.efficiency:.3f}, {cluster.inter.latency * 1e6:.0f} us; intra-node (loopback gloo, measured)"
        f" {cluster.intra.bandwidth / 1e9:.2f} GB/s, {cluster.intra.latency * 1e6:.0f} us; concurrency"
        f" {cluster.device.concurrency:.2f}; step overhead {args.step_overhead_ms:g} ms"
    )
    head = f"{'placement':<9} {'towers':<48} {'predicted ms':>12} {'measured ms':>11} {'per round ms':>18}"
    print(head)
    print("-" * len(head))
    for k in PLACEMENTS:
        rounds = "/".join(f"{t * 1e3:.0f}" for t in per_round[k])
        print(
            f"{k:<9} {describe(layouts[k]):<48} {predicted[k].step_time * 1e3:>12.1f} {measured[k] * 1e3:>11.1f}"
            f" {rounds:>18}"
        )
    print(
        "\nrank 0's step (an image replica), ms: predicted compute (forward, backward and optimizer, stretched by the"
        " node's other rank) | exposed gradient sum | batch-sync; measured forward + backward | batch-sync | the rest"
        " (gradient sum, optimizer, framework)"
    )
    for k in PLACEMENTS:
        tc = predicted[k].towers["image"]
        compute = sum(tc.segments) + tc.optimizer + tc.contention
        sync = predicted[k].sync.get("total", 0.0)
        wall, _, fwd, bwd, bsync = med[k][:5]  # (then the collectives' seconds)
        print(
            f"{k:<9} predicted {compute * 1e3:6.0f} | {tc.dp_exposed * 1e3:4.0f} | {sync * 1e3:3.0f}"
            f"    measured {(fwd + bwd) * 1e3:6.0f} | {bsync * 1e3:4.0f} | {(wall - fwd - bwd - bsync) * 1e3:4.0f}"
        )
    m_ratio = measured["naive"] / measured["planner"]
    p_ratio = predicted["naive"].step_time / predicted["planner"].step_time
    m_gap = (measured["naive"] - measured["planner"]) * 1e3
    p_gap = (predicted["naive"].step_time - predicted["planner"].step_time) * 1e3
    each = "/".join(f"{n / p:.2f}" for n, p in zip(per_round["naive"], per_round["planner"], strict=True))
    print(
        f"\nnaive / planner: measured {m_ratio:.2f}x (per round {each}), predicted {p_ratio:.2f}x;"
        f" naive's extra time per step measured {m_gap:.0f} ms, predicted {p_gap:.0f} ms"
    )


if __name__ == "__main__":
    main()
