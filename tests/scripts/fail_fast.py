"""Run one bad-input case under the real popen launcher; every rank records the error it raised."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from distmm_testing import TinyCLIP, trainer_kwargs  # noqa: E402
from test_errors import CASES, ErrorRecorder  # noqa: E402

import lightning_distmm as ldm  # noqa: E402

torch.set_num_threads(1)
case, folder = sys.argv[1], sys.argv[2]
world, plan, data, _, *extra = CASES[case]
module = extra[0]() if extra else TinyCLIP()
validate = extra[1:] == ["validate"]
trainer = L.Trainer(
    devices=world,
    max_steps=2,
    strategy=ldm.DistMMStrategy(plan),
    callbacks=[ErrorRecorder(folder)],
    **trainer_kwargs(limit_val_batches=2 if validate else 0),
)
if validate:
    trainer.validate(module, data())
else:
    trainer.fit(module, data())
os._exit(0)
