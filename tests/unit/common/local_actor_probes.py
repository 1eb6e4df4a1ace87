"""Classes for tests/unit/common/test_local_actors.py: a local actor's class must be importable by its child."""

from __future__ import annotations

import os
import sys
import threading
import time


class Counter:
    def __init__(self, start: int) -> None:
        self.value = start
        self.released = threading.Event()

    def add(self, amount: int) -> int:
        self.value += amount
        return self.value

    def fail(self) -> None:
        raise ValueError("bad input 7")

    def pid(self) -> int:
        return os.getpid()

    def env(self, name: str) -> str | None:
        return os.environ.get(name)

    def torch_threads(self) -> int:
        import torch

        return torch.get_num_threads()

    def loaded(self, module: str) -> bool:
        """Whether `module` was imported in this process (this class imports neither torch nor transformers)."""
        return module in sys.modules

    def say(self, text: str) -> None:
        print(text, flush=True)

    def start_sleeper(self) -> int:
        """A child that would outlive this process (as an environment's sandbox would); its pid."""
        import subprocess

        return subprocess.Popen(["sleep", "3600"]).pid

    def block(self) -> str:
        """Returns once `release` was called: only a threaded actor (max_concurrency > 1) gets there."""
        if not self.released.wait(120):
            return "never released"
        return "released"

    def release(self) -> None:
        self.released.set()

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def exit(self, code: int) -> None:
        os._exit(code)


class BrokenInit:
    def __init__(self) -> None:
        raise KeyError("no such model")


class BrokenRewardInit:
    """Raises an exception of a module (its traceback's last line is `common.reward_fns.RewardFnError: ...`)."""

    def __init__(self) -> None:
        from common.reward_fns import RewardFnError

        raise RewardFnError("`reward.fn` 'x.py:f': reward file 'x.py' has no function 'f'")
