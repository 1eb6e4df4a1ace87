"""The learner as the driver sees it: `learner.world_size` ranks as actors behind one blocking interface (Ray actors
or local ones, `ray.launcher`: `common.actors`).

Every rank is a `learner.trainer.Learner` actor; they meet in a torch.distributed process group at a rendezvous
address hosted here. Calls go to all ranks at once (FSDP2's collectives need every rank) and the answer comes from
rank 0, the one that talks to the buffer and to quant_sync. The learner's CPU request `ray.learner_cpus` is split
evenly over its ranks, so a world of 2 fits the same Ray cluster as a world of 1.
Each rank sets the learner's glibc malloc settings (`LEARNER_MALLOC`) with `mallopt` as its actor starts, before
torch is imported. The actor has no Ray `runtime_env`: an actor with one (even env vars alone) gets a process of its
own through Ray's runtime-env agent and `setup_worker.py`: 0.7-1.1 CPU-s and 2-6 s more from creation to ready than
one that takes a prestarted worker process (2 cores, measured under load; issue 27).
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

from common import actors
from common.config import RayConfig, to_dict
from learner.sections import LearnerSections

LEARNER_MALLOC = {"M_ARENA_MAX": 2, "M_MMAP_THRESHOLD": 2**30, "M_TRIM_THRESHOLD": -1, "M_TOP_PAD": 64 * 2**20}
"""glibc malloc settings of a learner rank: the step's activations and gradients (up to 1 GiB each) are reused from
the heap instead of being mapped, page-faulted and unmapped again every step, and freed heap is never trimmed on
free (`M_TRIM_THRESHOLD` -1: trimming off, mallopt(3)) but kept for the next step (`learner.memory.trim_heap` gives
it back after the first update, and later when the machine runs short); two arenas (a rank computes on few
threads). On the ~100M decode shape of `asyncrl bench e2e` the forward went from 0.9M page faults a step (3.7 GB,
1.2-3.3 s of system time) to a few thousand. Only allocations change: results are identical. The same as the
environment variables MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_, ... (which glibc reads at process start) for every
allocation made after `apply_malloc_settings`."""
MALLOPT_PARAMS = {"M_TRIM_THRESHOLD": -1, "M_TOP_PAD": -2, "M_MMAP_THRESHOLD": -3, "M_ARENA_MAX": -8}
"""glibc's `mallopt` parameter numbers (malloc.h)."""


RANK_DEATH_WAIT_S = 10.0
"""How long the other ranks' calls are waited for when one failed, to find a rank that died (`get_ranks`)."""


def get_ranks(refs: list[Any], among: list[Any] | None = None) -> list[Any]:
    """`actors.get` of `refs` (calls on the ranks); where one failed, a death among `among` (default: `refs`, the
    call on every rank) is raised first.

    A rank killed in a collective makes its peers fail at once (gloo: "Connection reset by peer"), often before the
    dead rank's own call reports its death: that error named a survivor and ended the run, where a learner that died
    is restarted from its checkpoint (`learner.max_restarts`)."""
    try:
        return actors.get(refs)
    except actors.task_errors() as err:
        calls = among if among is not None else refs
        if len(calls) > 1 and (died := death_among(calls)) is not None:
            raise died from err
        raise


def death_among(refs: list[Any], timeout_s: float = RANK_DEATH_WAIT_S) -> BaseException | None:
    """The error of a call in `refs` whose actor died, waiting up to `timeout_s` for them to end; None if none did."""
    ready, _ = actors.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for ref in ready:
        try:
            actors.get(ref)
        except actors.died_errors() as died:
            return died
        except BaseException:  # noqa: BLE001 - a survivor's error: the death is the one wanted
            continue
    return None


def apply_malloc_settings(settings: dict[str, int] | None = None) -> dict[str, int]:
    """Set glibc malloc parameters of this process with `mallopt` (default `LEARNER_MALLOC`); the ones that took.
    Nothing (an empty dict) under another C library."""
    import ctypes
    import ctypes.util

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    chosen = LEARNER_MALLOC if settings is None else settings
    return {name: value for name, value in chosen.items() if mallopt(MALLOPT_PARAMS[name], value) == 1}


def actor_options(ray_cfg: RayConfig, world: int, device: str = "cpu") -> dict[str, Any]:
    """Ray options of one learner rank: its share of `ray.learner_cpus` and resources, and with `learner.device` on
    CUDA of `ray.learner_gpus` (0: one GPU a rank; a local actor sees every GPU and picks its own,
    `learner.devices.rank_device`). No `runtime_env`: see the module docstring."""
    options: dict[str, Any] = {"num_cpus": ray_cfg.learner_cpus / world}
    if device != "cpu":  # `learner.device` on CUDA (the driver does not import torch, nor learner.devices)
        options["num_gpus"] = ray_cfg.learner_gpus / world if ray_cfg.learner_gpus > 0 else 1.0
    resources = {name: amount / world for name, amount in ray_cfg.learner_resources.items()}
    if resources:
        options["resources"] = resources
    return options


class LearnerActor:
    """The Ray actor of one learner rank: a `learner.trainer.Learner` built in the actor's own process. The driver,
    which only creates and calls it, never imports torch or transformers (about 1 CPU-second of its start-up)."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.malloc = apply_malloc_settings()  # before torch's first allocations
        from learner.trainer import Learner

        self.learner = Learner(*args, **kwargs)

    def weights_endpoint(self) -> str:
        return self.learner.weights_endpoint()

    def train_step(self, step: int) -> dict[str, float]:
        return self.learner.train_step(step)

    def save_checkpoint(self, out_dir: str) -> str:
        return self.learner.save_checkpoint(out_dir)

    def set_live(self, changes: dict[str, Any]) -> None:
        self.learner.set_live(changes)

    def evaluate(self, prompts: list[str], answers: list[str], max_new_tokens: int) -> float:
        return self.learner.evaluate(prompts, answers, max_new_tokens)

    def save(self, out_dir: str) -> str:
        return self.learner.save(out_dir)

    def close(self) -> None:
        self.learner.close()


class LearnerGroup:
    def __init__(
        self,
        sections: LearnerSections,
        ray_cfg: RayConfig,
        model_dir: str,
        buffer_endpoint: str,
        resume_dir: str = "",
        start_version: int = 0,
    ):
        """Start `sections.learner.world_size` ranks, each given `sections`; `ray_cfg` sizes their actors."""
        world = sections.learner.world_size
        self.store, address, self.store_dir = None, "", ""
        if world > 1:  # torch.distributed: imported only where there is more than one rank
            from learner.distributed import local_rendezvous, start_rendezvous

            if ray_cfg.address:  # ranks may be on other nodes: a TCP store (alive while the ranks are)
                self.store, address = start_rendezvous()
            else:  # one machine: a file store, no port
                self.store_dir = tempfile.mkdtemp(prefix="asyncrl-rdzv-")
                address = local_rendezvous(self.store_dir)
        actor = actors.remote(LearnerActor, **actor_options(ray_cfg, world, sections.learner.device))
        section_values = to_dict(sections)
        self.ranks = [
            actor.remote(section_values, model_dir, buffer_endpoint, rank=rank, rendezvous=address,
                         resume_dir=resume_dir, start_version=start_version)
            for rank in range(world)
        ]  # fmt: skip

    def _all(self, method: str, *args: Any) -> Any:
        return get_ranks([getattr(rank, method).remote(*args) for rank in self.ranks])[0]

    def weights_endpoint_ref(self) -> Any:
        """A ref of the publisher's endpoint, ready once rank 0 has published version 0."""
        return self.ranks[0].weights_endpoint.remote()

    def weights_endpoint(self) -> str:
        return actors.get(self.ranks[0].weights_endpoint.remote())

    def train_step(self, step: int) -> dict[str, float]:
        return self._all("train_step", step)

    def train_step_async(self, step: int) -> list[Any]:
        """Start train step `step` on every rank; the refs (rank 0's result first) for `actors.wait` / `actors.get`."""
        return [rank.train_step.remote(step) for rank in self.ranks]

    def save_checkpoint(self, out_dir: str) -> str:
        return self._all("save_checkpoint", out_dir)

    def set_live(self, changes: dict[str, Any]) -> None:
        self._all("set_live", changes)

    def evaluate(self, prompts: list[str], answers: list[str], max_new_tokens: int) -> float:
        return self._all("evaluate", prompts, answers, max_new_tokens)

    def save(self, out_dir: str) -> str:
        return self._all("save", out_dir)

    def close(self) -> None:
        try:
            self._all("close")
        finally:
            if self.store_dir:
                shutil.rmtree(self.store_dir, ignore_errors=True)
