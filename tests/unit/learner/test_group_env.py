"""A learner rank's Ray actor takes a plain worker process (no `runtime_env`) and sets the learner's glibc malloc
settings itself: a 256 MiB block (a step's activation, past the 32 MiB that glibc's threshold grows to by itself) then
comes from the heap instead of its own mmap (glibc's default threshold is 128 KiB), and the job's env vars still
reach it."""

from __future__ import annotations

import json
import subprocess
import sys

from learner.group import LEARNER_MALLOC, actor_options

MMAPPED_BLOCKS = """
def mmapped_blocks_of_a_256_mib_malloc():  # everything inside: Ray pickles an actor class of __main__ by value
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype, libc.malloc.restype = MallInfo2, ctypes.c_void_p
    libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
    before = libc.mallinfo2().hblks
    block = libc.malloc(256 * 2**20)
    added = libc.mallinfo2().hblks - before
    libc.free(block)
    return added
"""

PLAIN = (
    MMAPPED_BLOCKS
    + """
import json, sys
from learner.group import apply_malloc_settings
if sys.argv[1] == "apply":
    applied = apply_malloc_settings()
else:
    applied = {}
print("RESULT" + json.dumps({"applied": applied, "mmapped": mmapped_blocks_of_a_256_mib_malloc()}))
"""
)

ACTOR = (
    MMAPPED_BLOCKS
    + """
import json, os
from asyncrl.raycluster import connect
from common.config import load_config
from learner.group import actor_options, apply_malloc_settings

os.environ["PYTHONWARNINGS"] = "ignore"  # one of the env vars the run hands to every actor of the job
cfg = load_config(None, ["ray.num_cpus=2", "ray.learner_cpus=1"])
connect(cfg.ray, warn=lambda *_: None)
import ray

class Probe:  # what LearnerActor.__init__ does first
    def __init__(self):
        self.applied = apply_malloc_settings()

    def report(self):
        return {"applied": self.applied, "mmapped": mmapped_blocks_of_a_256_mib_malloc(),
                "warnings": os.environ.get("PYTHONWARNINGS")}

try:
    probe = ray.remote(**actor_options(cfg.ray, 1))(Probe).remote()
    print("RESULT" + json.dumps(ray.get(probe.report.remote(), timeout=120)))
finally:
    ray.shutdown()
"""
)


def _result(script: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert lines, done.stdout + done.stderr
    return json.loads(lines[0][len("RESULT") :])


def test_the_options_split_the_learner_cpus_and_start_no_runtime_env():
    from common.config import load_config

    ray_cfg = load_config(None, ["ray.num_cpus=4", "ray.learner_cpus=2"]).ray
    options = actor_options(ray_cfg, 2)
    assert options == {"num_cpus": 1.0}  # a runtime_env would cost a process of its own (learner/group.py)


def test_the_settings_keep_a_256_mib_block_on_the_heap():
    assert _result(PLAIN, "default") == {"applied": {}, "mmapped": 1}  # glibc's default: its own mapping
    assert _result(PLAIN, "apply") == {"applied": LEARNER_MALLOC, "mmapped": 0}


def test_a_rank_actor_applies_the_settings_and_sees_the_jobs_env_vars():
    assert _result(ACTOR) == {"applied": LEARNER_MALLOC, "mmapped": 0, "warnings": "ignore"}
