"""Compile a tiny ViT's blocks in this process and print what happened as JSON, for
``tests/test_compile.py``: torch.compile in a pytest worker leaves the process unable to run
autograd in processes it later forks, and the suite's distributed tests fork."""

import json
import logging

import torch

from lightning_distmm.models.tiny import tiny_vit
from lightning_distmm.parallel.compile import compile_tower


def failing_backend(gm, example_inputs):
    raise RuntimeError("this backend cannot compile anything")


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def fallback() -> dict:
    """A tower whose compilation fails runs eagerly, saying why once, its eager forwards back."""
    torch.manual_seed(0)
    vit = tiny_vit(8, 4, width=16, depth=2, heads=2, embed=8)
    x = torch.randn(3, 3, 8, 8)
    expected = vit(x)
    log = logging.getLogger("lightning_distmm.parallel.compile")
    log.setLevel(logging.INFO)
    handler = Records()
    log.addHandler(handler)
    compiled = compile_tower("image", vit, backend=failing_backend)
    regions = len(compiled.regions)
    out = vit(x)
    vit(x)  # the fallback is said once
    log.removeHandler(handler)
    return {
        "regions": regions,
        "equal": bool(torch.equal(out, expected)),
        "failure": compiled.failure,
        "warnings": [r.getMessage() for r in handler.records if r.levelno == logging.WARNING],
        "restored": all("forward" not in block.__dict__ for block in vit.blocks),
    }


def own_error() -> dict:
    """The module's own error is the one raised when eager fails too."""
    vit = tiny_vit(8, 4, width=16, depth=1, heads=2, embed=8)
    compile_tower("image", vit, backend=failing_backend)
    try:
        vit.blocks[0](torch.randn(2, 5, 7))  # width 7 where the block takes 16: eager's own shape error
    except RuntimeError as err:
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": ""}


def compiled_again() -> dict:
    """A second Trainer call in the same process (fit, then validate) prepares the module again."""
    vit = tiny_vit(8, 4, width=16, depth=2, heads=2, embed=8)
    first = compile_tower("image", vit, backend="eager")
    same = compile_tower("image", vit, backend="eager") is first
    vit(torch.randn(3, 3, 8, 8))
    return {"same": same, "failure": first.failure}


if __name__ == "__main__":
    print(json.dumps({"fallback": fallback(), "own_error": own_error(), "compiled_again": compiled_again()}))
