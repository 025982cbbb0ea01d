"""benchmarks/gpu_calibrate.py on the CPU (its smoke path: tiny sizes, fp32, gloo), so the script a lent
GPU will run cannot rot, and the loader that turns its JSON into a device profile
(lightning_distmm.planner.machine.calibration). No timing assertions: the CPU numbers only feed the schema."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from forked_main import main_in_fork, script_module

from lightning_distmm.planner import load_cluster, make_plan
from lightning_distmm.planner.machine.calibration import (
    SCHEMA,
    CalibrationError,
    cluster_from_calibration,
    device_from_calibration,
    gemm_class_efficiency,
    load_calibration,
    tower_steps,
)
from lightning_distmm.planner.machine.cluster import CONF_DIR, Cluster

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_calibrate.py"
SMOKE = ROOT / "tests" / "data" / "calibration_cpu_smoke.json"  # written by the CPU smoke run: not GPU numbers


def run_script(tmp_path: Path, *args: str) -> tuple[int | None, str]:
    """The script's ``main`` in a forked child of this process (no fresh interpreter importing torch
    and lightning first): its exit code and its output."""
    module = script_module(SCRIPT)
    log = tmp_path / "gpu_calibrate.log"
    env = {"MASTER_PORT": None, "MASTER_ADDR": None}
    _, code = main_in_fork(module.main, list(args), log, timeout=300, env=env)
    return code, log.read_text()


@pytest.mark.slow
def test_cpu_smoke_run_writes_every_section(tmp_path):
    out = tmp_path / "tmp.json"
    code, said = run_script(tmp_path, "--cpu-smoke", "--out", str(out))
    assert code == 0, said[-3000:]
    assert "GEMM by size" in said and "tower step" in said and "gloo world 1" in said
    data = json.loads(out.read_text())
    assert data["schema"] == SCHEMA and data["kind"] == "cpu-smoke" and "NOT GPU" in data["note"]
    assert data["errors"] == [] and data["budget"]["complete"] and data["budget"]["skipped"] == []
    dev = data["device"]
    assert dev["peak_tflops"] > 0 and dev["memory_bandwidth_gbps"] > 0 and dev["memory_gb"] > 0
    assert dev["dtype"] == "float32" and dev["sm_count"] is None
    labels = {r["label"] for r in data["gemm"]}
    assert {"d32 qkv", "d64 fc2", "d64 fc1.wgrad", "square 128"} <= labels
    for r in data["gemm"]:
        assert r["flops"] == 2.0 * r["m"] * r["n"] * r["k"]
        assert r["seconds"] > 0 and 0 < r["fraction_of_peak"] <= 1.0 + 1e-9
        assert r["tflops"] == pytest.approx(r["flops"] / r["seconds"] / 1e12)
    towers = {(r["model"], r["microbatch"]) for r in data["models"]}
    assert towers == {(m, b) for m in ("vit_smoke", "clip_text_smoke") for b in (2, 4)} | {("vit_l_smoke", 2)}
    for r in data["models"]:
        assert r["seconds"] > 0 and r["flops"] > 0 and 0 < r["mfu"] and r["peak_memory_gb"] is None
        # the planner's analytic prediction of the same tower and microbatch on the measured device
        assert r["predicted_seconds"] > 0 and r["time_ratio"] == pytest.approx(r["seconds"] / r["predicted_seconds"])
        assert r["predicted_memory_gb"] > 0 and "memory_ratio" not in r  # no allocator statistics on a CPU
    # FLOPs counted once and scaled: twice the samples, twice the FLOPs
    by = {(r["model"], r["microbatch"]): r["flops"] for r in data["models"]}
    assert by[("vit_smoke", 4)] == pytest.approx(2 * by[("vit_smoke", 2)])
    nccl = data["nccl"]
    assert nccl["backend"] == "gloo" and nccl["world_size"] == 1 and nccl["init_seconds"] > 0
    assert [a["bytes"] for a in nccl["allreduce"]] == [4, 2**16] and "latency floor" in nccl["note"]
    load_calibration(out)  # what the script writes, the loader reads


@pytest.mark.slow
def test_timeout_stops_cleanly_and_still_writes(tmp_path):
    out = tmp_path / "cut.json"
    code, said = run_script(tmp_path, "--cpu-smoke", "--out", str(out), "--timeout-s", "0.5")
    assert code == 0, said[-3000:]
    data = json.loads(out.read_text())
    assert not data["budget"]["complete"] and data["budget"]["skipped"]
    assert data["gemm"] == [] and data["models"] == [] and data["nccl"] is None
    with pytest.raises(CalibrationError, match="no GEMM was measured"):
        load_calibration(out)


def test_committed_smoke_json_loads_as_a_device_profile():
    data = load_calibration(SMOKE)
    assert data["kind"] == "cpu-smoke"
    cl = cluster_from_calibration(SMOKE, base=load_cluster("a100_8x8"), name="smoke")
    base = load_cluster("a100_8x8")
    assert cl.name == "smoke" and (cl.nodes, cl.devices_per_node) == (8, 8)
    assert cl.intra == base.intra and cl.inter == base.inter and cl.nccl == base.nccl
    dev = cl.device
    assert dev.peak_flops == pytest.approx(data["device"]["peak_tflops"] * 1e12)
    assert dev.memory_bandwidth == pytest.approx(data["device"]["memory_bandwidth_gbps"] * 1e9)
    classes = dev.gemm_class_efficiency
    assert classes and [p[0] for p in classes] == sorted(p[0] for p in classes)
    for flops, eff in classes:  # the roofline's efficiency at a class's centre is the class's
        assert float(dev.compute_efficiency(flops)) == pytest.approx(eff)
    # a plan can be made on it, and the preset form ({calibration, base}) loads the same device
    spec = {"name": "smoke", "calibration": str(SMOKE.relative_to(ROOT)), "base": "a100_8x8"}
    assert load_cluster(spec).device == dev
    model = yaml.safe_load((CONF_DIR / "model" / "clip_vit_b32.yaml").read_text())
    _, rep = make_plan(model, load_cluster(spec), 1024)
    assert rep.step_time > 0
    assert np.allclose(Cluster.from_dict(cl.to_dict()).device.gemm_class_efficiency, classes)
    with pytest.raises(ValueError, match="calibration file"):
        Cluster.from_dict(spec)
    assert {r["model"] for r in tower_steps(SMOKE)} == {"vit_smoke", "clip_text_smoke"}


def test_class_efficiency_undoes_wave_quantisation():
    """A 128x128 output fills at best 4 of 132 SMs (four 64x64 tiles): measured at 0.5% of peak, those
    SMs ran at 0.005 * 132 / 4 = 16.5%; the class stores that, and the roofline gives back the measured
    time for the shape."""
    seconds = 2.0 * 128 * 128 * 4096 / (0.005 * 989e12)
    row = {"label": "x", "m": 128, "n": 128, "k": 4096, "flops": 2.0 * 128 * 128 * 4096, "seconds": seconds}
    row["fraction_of_peak"] = 0.005
    cal = {
        "schema": SCHEMA,
        "kind": "cuda",
        "device": {
            "name": "H200",
            "memory_gb": 141,
            "peak_tflops": 989,
            "sm_count": 132,
            "memory_bandwidth_gbps": 4000,
        },
        "gemm": [row],
        "models": [],
        "nccl": None,
        "budget": {},
        "errors": [],
    }
    assert gemm_class_efficiency(cal, 132) == [[pytest.approx(row["flops"]), pytest.approx(0.005 * 132 / 4)]]
    dev = device_from_calibration(cal)
    t = dev.gemm_time(row["flops"], 2 * (128 * 4096 * 2 + 128 * 128), 128, 128)
    assert float(np.asarray(t)) == pytest.approx(seconds)


def test_measured_preset_says_how_to_make_its_file():
    if (ROOT / "benchmarks" / "results" / "h200_calibration.json").is_file():
        assert load_cluster("h200_measured").device.gemm_class_efficiency
    else:
        with pytest.raises(CalibrationError, match="gpu_calibrate.py"):
            load_cluster("h200_measured")
