"""A benchmark script's ``main(argv)`` run in a forked child of the test process, for the slow tests
that check a script end to end: the child shares the test process's ``import lightning`` (seconds per
fresh interpreter on this host, paid once per pytest worker), and is otherwise what the script's own
process does (its own session; its output, and that of every process it starts, in a file)."""

from __future__ import annotations

import gc
import importlib.util
import multiprocessing as mp
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType


def script_module(path: Path, name: str | None = None) -> ModuleType:
    """The script at ``path`` imported as the module ``name`` (its file name by default), registered
    in ``sys.modules`` (dataclasses look their module up there); its ``__main__`` block does not run."""
    name = name or path.stem
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main_in_fork(
    main: Callable[[Sequence[str]], object],
    argv: Sequence[str],
    log: Path,
    timeout: float,
    env: Mapping[str, str | None] | None = None,
) -> tuple[int, int | None]:
    """``sys.exit(main(argv))`` in a forked child whose stdout and stderr (file descriptors 1 and 2,
    which the processes it starts inherit) go to ``log``; ``env``: variables set in the child's
    environment (None: removed). Past ``timeout`` the child gets SIGTERM (the scripts clean up on it), then
    SIGKILL after 60 s. Returns the child's pid and exit code (a negative signal number if killed)."""

    def child() -> None:
        os.setsid()
        gc.freeze()  # the test process's objects stay out of the child's collections
        for key, value in (env or {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the child's whole life
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.exit(main(list(argv)))

    proc = mp.get_context("fork").Process(target=child)
    proc.start()
    try:
        proc.join(timeout)
    finally:
        if proc.is_alive():
            proc.terminate()
            proc.join(60)
            if proc.is_alive():
                proc.kill()
                proc.join()
    assert proc.pid is not None
    return proc.pid, proc.exitcode
