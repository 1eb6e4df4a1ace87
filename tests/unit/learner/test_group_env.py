"""A learner rank's Ray actor process starts with the learner's glibc malloc settings, beside the job's env vars."""

from __future__ import annotations

import json
import subprocess
import sys

from learner.group import LEARNER_MALLOC_ENV, actor_options

PROBE = """
import json, os, sys
from asyncrl.raycluster import connect
from common.config import load_config
from learner.group import LEARNER_MALLOC_ENV, actor_options

os.environ["PYTHONWARNINGS"] = "ignore"  # one of the env vars the run hands to every actor of the job
cfg = load_config(None, ["ray.num_cpus=2", "ray.learner_cpus=1"])
connect(cfg.ray, warn=lambda *_: None)
import ray

class Probe:
    def env(self):
        return {k: os.environ.get(k) for k in [*LEARNER_MALLOC_ENV, "PYTHONWARNINGS"]}

try:
    probe = ray.remote(**actor_options(cfg.ray, 1))(Probe).remote()
    print("ENV" + json.dumps(ray.get(probe.env.remote(), timeout=120)))
finally:
    ray.shutdown()
"""


def test_the_options_split_the_learner_cpus_and_carry_the_malloc_settings():
    from common.config import load_config

    ray_cfg = load_config(None, ["ray.num_cpus=4", "ray.learner_cpus=2"]).ray
    options = actor_options(ray_cfg, 2)
    assert options["num_cpus"] == 1.0
    assert options["runtime_env"] == {"env_vars": LEARNER_MALLOC_ENV}
    assert int(LEARNER_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]) <= 32 * 2**20  # glibc ignores a larger threshold


def test_a_rank_process_sees_the_malloc_settings_and_the_jobs_env_vars():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ENV")]
    assert lines, done.stdout + done.stderr
    env = json.loads(lines[0][3:])
    assert env == {**LEARNER_MALLOC_ENV, "PYTHONWARNINGS": "ignore"}  # added to the environment, not replacing it
