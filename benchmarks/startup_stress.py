"""Start the README's job many times in a row and check that every start succeeds and that nothing is
left in the temp dir afterwards.

Each run is ``recipes/train.py`` on 2 CPU ranks (Lightning's subprocess launcher) for a few steps,
then ``trainer.validate`` on the same ranks (the recipe's own last validation): two trainer calls of
one run, the interleaving in which one rank's teardown once removed the run folder another rank was
entering (1 start in 9 failed with ``FileNotFoundError: .../rank1.proc.tmp<pid>``). Every run of a
plan shares one fresh temp dir (``TMPDIR``), so a file any run leaves behind is seen at the end.

    python benchmarks/startup_stress.py                      # 30 x plan=auto, 30 x the default plan
    python benchmarks/startup_stress.py --runs 5 --plans auto

Prints one line per run (exit code, seconds) and a summary per plan; exits 1 if any run failed or
left a file. ``torchinductor_<user>`` is torch's own compile cache (``import lightning`` makes it
through torchmetrics), not this package's, and is listed but not counted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: what torch itself creates under the temp dir when imported (not written by this package)
FOREIGN = ("torchinductor_",)


def one_run(plan: str, temp: Path, out: Path, devices: int, steps: int) -> tuple[int, float, str]:
    overrides = [
        f"strategy.plan={plan}",
        f"trainer.devices={devices}",
        f"trainer.max_steps={steps}",
        "+trainer.limit_val_batches=2",
        "eval.enabled=false",
        f"hydra.run.dir={out}",
    ]
    env = {**os.environ, "TMPDIR": str(temp)}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "train.py"), *overrides],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.returncode, time.monotonic() - start, (proc.stdout + proc.stderr)[-3000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--plans", nargs="+", default=["auto", "default"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    failed_any = False
    with tempfile.TemporaryDirectory(prefix="distmm-stress-") as scratch:
        for plan in args.plans:
            temp = Path(scratch) / f"tmp-{plan}"
            temp.mkdir()
            codes, seconds = [], []
            for i in range(args.runs):
                code, took, tail = one_run(plan, temp, Path(scratch) / f"out-{plan}-{i}", args.devices, args.steps)
                codes.append(code)
                seconds.append(took)
                print(f"plan={plan} run {i + 1:2d}/{args.runs}: rc {code}  {took:5.1f} s", flush=True)
                if code != 0:
                    print("  last output:\n  " + tail.replace("\n", "\n  "), flush=True)
            entries = sorted(str(p.relative_to(temp)) for p in temp.iterdir())
            left = [e for e in entries if not e.startswith(FOREIGN)]
            foreign = [e for e in entries if e.startswith(FOREIGN)]
            failures = sum(c != 0 for c in codes)
            print(
                f"plan={plan}: {args.runs - failures}/{args.runs} runs succeeded, median {statistics.median(seconds):.1f} s"
                f" per run; left in the temp dir: {left or 'nothing'}"
                + (f" (torch's own, not counted: {foreign})" if foreign else ""),
                flush=True,
            )
            failed_any |= failures > 0 or bool(left)
    return 1 if failed_any else 0


if __name__ == "__main__":
    sys.exit(main())
