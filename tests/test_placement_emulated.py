"""benchmarks/placement_emulated.py: its pure parts (the cluster spec it builds from the tc settings,
the tc commands, the two placements it compares, the leftover cleanup) without namespaces, and one
slow run at the tiniest size where root and ``ip netns`` are available."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from forked_main import main_in_fork, script_module

from lightning_distmm.planner import Cluster, Device, Link, model_profiles, price_plan

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "placement_emulated.py"


pe = script_module(SCRIPT)


def host() -> Cluster:
    """A measured-looking host of 2 CPU processes (what measure_local_cpu returns), made up."""
    device = Device("cpu/1t", 8e9, 50e9, 10e9, kernel_overhead=2e-6, concurrency=1.0)
    loopback = Link(bandwidth=0.8e9, latency=150e-6)
    return Cluster("local_cpu", 1, 2, device, loopback, Link(0.8e9, 150e-6))


def test_cluster_spec_is_the_tc_settings():
    link = pe.LinkSettings(rate_mbit=100, delay_ms=2.0)
    cl = pe.emulated_cluster(host(), link, concurrency=1.9)
    assert (cl.nodes, cl.devices_per_node, cl.world_size) == (2, 2, 4)
    assert cl.inter.bandwidth == pytest.approx(100e6 / 8)  # bytes/s of the tbf rate, per node and direction
    assert cl.inter.latency == pytest.approx(150e-6 + 2e-3)  # gloo's step latency + the netem delay
    assert cl.inter.efficiency == pytest.approx((1500 - 52) / (1500 + 14), abs=1e-4)  # TCP payload of a full frame
    assert cl.intra == host().intra  # inside a node: loopback, as measured
    assert cl.device.concurrency == 1.9 and cl.device.peak_flops == host().device.peak_flops
    assert Cluster.from_dict(cl.to_dict()).inter == cl.inter  # a plain spec: YAML round trip
    assert pe.emulated_cluster(host(), pe.LinkSettings(50)).inter.bandwidth == pytest.approx(50e6 / 8)


def test_tc_commands():
    (tbf,) = pe.LinkSettings(rate_mbit=200).tc_commands("v0")
    assert tbf[:8] == ["tc", "qdisc", "replace", "dev", "v0", "root", "handle", "1:"]
    assert tbf[8:11] == ["tbf", "rate", "200mbit"]
    burst = int(tbf[tbf.index("burst") + 1])
    assert burst == 65536  # a GSO segment: a quarter millisecond of 200 Mbit/s is less
    assert pe.LinkSettings(rate_mbit=5000).burst_bytes == int(5000e6 / 8 * 0.25e-3)  # a quarter ms of the rate
    assert pe.LinkSettings(rate_mbit=200, burst_kib=512).burst_bytes == 512 * 1024
    netem, child = pe.LinkSettings(rate_mbit=50, delay_ms=5).tc_commands("v1")
    assert netem[netem.index("netem") :] == ["netem", "delay", "5ms"]
    assert child[5:8] == ["parent", "1:1", "handle"] and "50mbit" in child


def test_the_two_placements_differ_in_where_the_heavy_group_lands():
    sizes = {"image": 2, "text": 2}
    cl = pe.emulated_cluster(host(), pe.LinkSettings(200))
    profiles = model_profiles(pe.SMALL)

    def score(layout):
        return price_plan(pe.to_plan(layout, 32), profiles, cl, pe.planner_options(0.0)).step_time

    for planner in (pe.planner_layout(sizes, cl), pe.planner_layout(sizes, cl, score)):
        assert sorted(r for rs in planner.values() for r in rs) == [0, 1, 2, 3]
        assert all(len(pe.nodes_of(rs)) == 1 for rs in planner.values())  # every group inside a node
    naive = pe.naive_layout(sizes)
    assert naive == {"image": [0, 2], "text": [1, 3]}
    assert all(pe.nodes_of(rs) == [0, 1] for rs in naive.values())  # every group across the link
    assert pe.naive_layout({"a": 1, "b": 3}) == {"a": [0], "b": [1, 2, 3]}
    assert "image@0,2 (nodes 0,1)" in pe.describe(naive)

    # the model prices the crossing: slower, and more so on a slower link
    def ratio(mbit):
        c = pe.emulated_cluster(host(), pe.LinkSettings(mbit))
        price = {
            k: price_plan(pe.to_plan(lay, 32), profiles, c, pe.planner_options(0.0)).step_time
            for k, lay in (("planner", pe.planner_layout(sizes, c)), ("naive", naive))
        }
        return price["naive"] / price["planner"]

    assert 1.0 < ratio(1000) < ratio(200) < ratio(50)


def test_leftovers_of_gone_runs_only():
    listing = "ldmpe123a (id: 1)\nldmpe123b (id: 0)\nldmpe456a\nldmpe456b\nother\nldmpeXa\n"
    assert pe.leftover_namespaces(listing, alive=lambda pid: pid == 456) == ["ldmpe123a", "ldmpe123b"]
    assert pe.leftover_namespaces("", alive=lambda pid: False) == []
    emu = pe.Emulation(pe.LinkSettings(), tag="77")
    assert emu.ns == ("ldmpe77a", "ldmpe77b") and all(len(d) <= 15 for d in emu.dev)


def test_arguments():
    args = pe.parse_args(["--steps", "2", "--warmup", "0", "--profile-batches", "4,8"])
    assert (args.steps, args.warmup, args.profile_batches, args.pin) == (2, 0, (4, 8), True)
    with pytest.raises(SystemExit):
        pe.parse_args(["--steps", "3", "--warmup", "3"])


@pytest.mark.slow
@pytest.mark.skipif(pe.preflight() is not None, reason=f"placement_emulated: {pe.preflight()}")
def test_benchmark_runs_at_the_tiniest_size(tmp_path):
    """Both placements trained in two namespaces over a shaped veth, then nothing of it left. The
    script's ``main`` runs in a forked child of this process (no fresh interpreter's ``import
    lightning``); one launch runs both placements, each 2 steps; the probe measures concurrency once."""
    argv = ["--model", "tiny", "--rounds", "1", "--steps", "2", "--warmup", "0", "--batch", "8"]
    argv += ["--profile-batches", "4,8", "--profile-repeats", "1", "--concurrency-rounds", "1", "--cached-host"]
    import lightning_distmm.models.clip  # noqa: F401  (loaded here once: the forked benchmark shares it)

    log = tmp_path / "benchmark.log"
    pid, code = main_in_fork(pe.main, argv, log, timeout=240)
    out = log.read_text()
    assert code == 0, out[-4000:]
    assert re.search(r"ranks on namespaces \[(0, 0, 1, 1|1, 1, 0, 0)\]", out)  # two per node, in order
    assert "naive / planner: measured" in out and "predicted" in out
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"ldmpe{pid}" not in listing
