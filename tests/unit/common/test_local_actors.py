"""Local actors (`ray.launcher: local`): real child processes serving calls over ZMQ through `common.actors`, the
interface the driver uses under both launchers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

import psutil
import pytest
from local_actor_probes import BrokenInit, BrokenRewardInit, Counter

from asyncrl.watchdog import actor_death
from common import actors, zygote
from common.config import load_config


@pytest.fixture
def local():
    actors.use("local")
    yield
    actors.shutdown()
    actors.use("ray")


def test_calls_run_in_order_and_a_ref_is_an_argument(local):
    counter = actors.remote(Counter, num_cpus=1).remote(10)
    refs = [counter.add.remote(n) for n in (1, 2, 3)]
    assert actors.get(refs) == [11, 13, 16]
    assert actors.get(counter.add.remote(refs[0])) == 27  # waits for the ref, then sends its value
    other = actors.remote(Counter).remote(0)
    assert actors.get(other.add.remote(counter.add.remote(1)), timeout=60) == 28
    ready, not_ready = actors.wait(refs, num_returns=3, timeout=60)
    assert ready == refs and not_ready == []
    assert actors.get(counter.pid.remote()) != os.getpid()


def test_a_method_error_names_the_method_and_keeps_the_actor(local):
    counter = actors.remote(Counter).remote(1)
    with pytest.raises(actors.task_errors()) as caught:
        actors.get(counter.fail.remote())
    err = caught.value
    assert isinstance(err.cause, ValueError) and "bad input 7" in str(err.cause)
    assert err.function_name == "Counter.fail" and err.pid == actors.get(counter.pid.remote())
    assert "Traceback" in str(err) and "bad input 7" in str(err)
    assert actors.get(counter.add.remote(1)) == 2  # the actor goes on, as a Ray actor does


def test_kill_fails_calls_in_flight_and_later_ones(local):
    counter = actors.remote(Counter).remote(0)
    pid = actors.get(counter.pid.remote())
    in_flight = counter.sleep.remote(600)
    actors.kill(counter)
    for ref in (in_flight, counter.add.remote(1)):
        with pytest.raises(actors.died_errors()) as caught:
            actors.get(ref, timeout=60)
        assert "class_name: Counter" in str(caught.value) and f"pid={pid}" in str(caught.value)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_process_that_exits_is_an_actor_death(local):
    counter = actors.remote(Counter).remote(0)
    pid = actors.get(counter.pid.remote())
    with pytest.raises(actors.died_errors()) as caught:
        actors.get(counter.exit.remote(3), timeout=60)
    assert "exit code 3" in str(caught.value)
    assert actor_death(str(caught.value)).startswith(
        f"an actor of the run (pid {pid}) died (the process ended with exit code 3"
    )
    other = actors.remote(Counter).remote(0)
    os.kill(actors.get(other.pid.remote()), signal.SIGKILL)  # from outside, as the OOM killer or a user would
    with pytest.raises(actors.died_errors(), match="killed by SIGKILL"):
        actors.get(other.add.remote(1), timeout=60)


def test_actors_fork_from_a_zygote_with_torch_imported_and_are_the_drivers_children(local):
    counter = actors.remote(Counter).remote(0)
    pid = actors.get(counter.pid.remote())
    assert psutil.Process(pid).ppid() == os.getpid()  # reparented to the driver, which reads its exit status
    assert actors.get(counter.loaded.remote("torch")) and actors.get(counter.loaded.remote("transformers"))
    assert actors.get(counter.env.remote("OMP_NUM_THREADS")) is not None  # the environment the driver gave
    zygote_pid = zygote.start().process.pid
    assert psutil.Process(zygote_pid).ppid() == os.getpid() and zygote_pid != pid


def test_without_the_zygote_an_actor_is_a_fresh_interpreter(local, monkeypatch):
    monkeypatch.setattr(zygote, "_zygote", None)
    monkeypatch.setattr(zygote, "_failed", True)  # as with ASYNCRL_ZYGOTE=0 or off Linux
    counter = actors.remote(Counter).remote(0)
    assert not actors.get(counter.loaded.remote("torch"))
    assert psutil.Process(actors.get(counter.pid.remote())).ppid() == os.getpid()
    assert actors.get(counter.add.remote(2)) == 2


def test_a_constructor_error_is_the_actor_death(local):
    broken = actors.remote(BrokenInit).remote()
    with pytest.raises(actors.died_errors(), match="constructor raised KeyError: 'no such model'") as caught:
        actors.get(broken.anything.remote(), timeout=60)
    assert "KeyError: KeyError" not in str(caught.value)  # the traceback's last line names the type once
    assert actor_death(str(caught.value)).endswith("died (its constructor raised KeyError: 'no such model')")
    assert actors.init_failed(caught.value)  # as Ray's `actor_init_failed`: the driver does not restart it
    broken = actors.remote(BrokenRewardInit).remote()
    with pytest.raises(actors.died_errors()) as caught:
        actors.get(broken.anything.remote(), timeout=60)
    assert actor_death(str(caught.value)).endswith(
        "died (its constructor raised RewardFnError: `reward.fn` 'x.py:f': reward file 'x.py' has no function 'f')"
    )  # its type named once


def test_a_killed_actor_did_not_fail_in_its_constructor(local):
    counter = actors.remote(Counter).remote(0)
    assert actors.get(counter.add.remote(1), timeout=60) == 1
    actors.kill(counter)
    with pytest.raises(actors.died_errors()) as caught:
        actors.get(counter.add.remote(1), timeout=60)
    assert not actors.init_failed(caught.value)


def test_rays_own_constructor_error_is_read_as_one():
    from ray.exceptions import ActorDiedError, RayTaskError

    try:
        raise RuntimeError("`learner.device=cuda` but this learner process sees no GPU (torch 2.13.0+cpu)")
    except RuntimeError as exc:
        traceback_text = "".join(traceback.format_exception(exc))
        died = ActorDiedError(RayTaskError("LearnerActor.__init__", traceback_text, exc, "ray::LearnerActor.__init__",
                                          pid=4321, ip="127.0.0.1"))  # fmt: skip
    assert actors.init_failed(died)
    assert actor_death(str(died)) == (
        "the learner (pid 4321) died (its constructor raised RuntimeError: "
        "`learner.device=cuda` but this learner process sees no GPU (torch 2.13.0+cpu))"
    )


def test_the_death_of_an_actor_keeps_its_errors_dots_and_a_crash_gets_its_hint():
    error = "RuntimeError: `learner.device=cuda` but this learner process sees no GPU (torch 2.13.0)"
    message = f"The actor died. class_name: LearnerActor, pid=7, exit detail: its constructor raised {error}."
    assert actor_death(message) == f"the learner (pid 7) died (its constructor raised {error})"
    ray_text = ("The actor died unexpectedly before finishing this task. class_name: RolloutWorker, Worker PID: 42, "
                "exit detail: Worker exits unexpectedly by a signal. SystemExit is raised.")  # fmt: skip
    assert actor_death(ray_text) == ("a rollout worker (pid 42) died (Worker exits unexpectedly by a signal: killed "
                                     "by a signal, out of memory or a crash)")  # fmt: skip


def test_max_concurrency_runs_calls_on_threads(local):
    threaded = actors.remote(Counter, max_concurrency=2).remote(0)
    blocked = threaded.block.remote()  # returns only once `release` ran beside it
    actors.get(threaded.release.remote(), timeout=60)
    assert actors.get(blocked, timeout=60) == "released"


def test_threads_follow_num_cpus_as_in_ray(local, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert actors.get(actors.remote(Counter, num_cpus=0.5).remote(0).env.remote("OMP_NUM_THREADS")) == "1"
    two = actors.remote(Counter, num_cpus=2).remote(0)
    assert actors.get(two.env.remote("OMP_NUM_THREADS")) == "2" and actors.get(two.torch_threads.remote()) == 2
    assert actors.get(actors.remote(Counter, num_cpus=1).remote(0).torch_threads.remote()) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's value wins
    assert actors.get(actors.remote(Counter, num_cpus=2).remote(0).env.remote("OMP_NUM_THREADS")) == "3"


def test_refusals_name_what_is_wrong(local):
    with pytest.raises(ValueError, match="need a Ray cluster"):
        actors.remote(Counter, resources={"rollout_node": 1})
    with pytest.raises(TypeError, match="runtime_env"):
        actors.remote(Counter, runtime_env={})


def test_actors_end_with_the_driver(tmp_path: Path):
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from common import actors\nfrom local_actor_probes import Counter\n"
        "actors.use('local')\nc = actors.remote(Counter).remote(0)\n"
        "print(actors.get(c.pid.remote()), flush=True)\nimport time; time.sleep(600)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script, str(Path(__file__).parent)], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        child = psutil.Process(int(driver.stdout.readline()))
        driver.kill()  # SIGKILL: no atexit, no shutdown
        child.wait(60)  # the child watches its parent and exits
    finally:
        driver.kill()
        driver.wait()


def test_output_reaches_the_driver_with_the_actor_prefix(tmp_path: Path):
    script = (
        "import sys; sys.path.insert(0, sys.argv[1])\n"
        "from common import actors\nfrom local_actor_probes import Counter\n"
        "actors.use('local')\nc = actors.remote(Counter).remote(0)\n"
        "actors.get(c.say.remote('hello from the actor'))\nprint('PID', actors.get(c.pid.remote()), flush=True)\n"
        "actors.shutdown()\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(Path(__file__).parent)], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    pid = done.stdout.split("PID ")[1].split()[0]
    assert f"(Counter pid={pid}) hello from the actor" in done.stdout


def test_auto_is_local_on_one_machine():
    assert actors.resolve_launcher(load_config(None, ["ray.launcher=auto"]).ray) == "local"
    assert actors.resolve_launcher(load_config(None, ["ray.launcher=auto", "ray.address=auto"]).ray) == "ray"
    with_resources = load_config(None, ["ray.launcher=auto", "ray.worker_resources={rollout_node: 0.1}"])
    assert actors.resolve_launcher(with_resources.ray) == "ray"
    assert actors.resolve_launcher(load_config(None, ["ray.launcher=ray"]).ray) == "ray"


def test_wait_returns_what_is_ready_by_the_timeout(local):
    counter = actors.remote(Counter, max_concurrency=2).remote(0)
    blocked, quick = counter.block.remote(), counter.add.remote(5)
    ready, not_ready = actors.wait([blocked, quick], num_returns=1, timeout=120)
    assert ready == [quick] and not_ready == [blocked]
    assert actors.wait([blocked], timeout=0) == ([], [blocked])
    with pytest.raises(TimeoutError):
        actors.get(blocked, timeout=0)
    counter.release.remote()
    assert actors.get(blocked, timeout=60) == "released"


def test_a_tmpdir_too_long_for_socket_paths_falls_back_to_a_short_one(tmp_path, monkeypatch) -> None:
    """A 76-character $TMPDIR (a cluster job's scratch) failed every run: `ipc path ... is longer than 107`."""
    import tempfile

    from common import local_actors

    long_dir = tmp_path / ("t" * (local_actors.SOCKET_PATH_MAX - local_actors._SOCKET_NAME_ROOM))
    long_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_dir))
    assert local_actors._socket_base() == "/tmp"
    short = tempfile.mkdtemp(dir="/tmp", prefix="s")
    try:
        monkeypatch.setattr(tempfile, "tempdir", short)
        assert local_actors._socket_base() == short  # $TMPDIR wins when its paths fit
    finally:
        os.rmdir(short)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_what_an_actor_started_ends_with_it_killed_or_stopped(local):
    """An environment that started `sleep 3600` in each step left 48 of them running after the run, reparented to
    init: each actor now leads a process group, which the driver ends with it."""
    import time

    killed, stopped = actors.remote(Counter).remote(0), actors.remote(Counter).remote(0)
    children = [actors.get(killed.start_sleeper.remote()), actors.get(stopped.start_sleeper.remote())]
    actor_pid = actors.get(killed.pid.remote())
    assert os.getpgid(actor_pid) == actor_pid  # a process group of its own,
    assert os.getsid(actor_pid) == os.getsid(0)  # in the driver's session: one scheduler autogroup, where the
    # workers' SCHED_IDLE holds against the learner (a session each took the INT8 decode bench's learner 14 s -> 19 s)
    actors.kill(killed)  # a restart's kill
    actors.shutdown()  # the end of a run: SIGTERM, then the group
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in children if not _gone(pid)] == []


FORK_ACTOR_AFTER_ITS_INTERMEDIATE_EXITED = """
import ctypes, json, os, socket, sys
from common import zygote

ctypes.CDLL(None).prctl(zygote.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # this process plays the driver
real_fork, forks = os.fork, []

def fork_then_wait_for_the_intermediate_to_exit():
    parent = os.getpid()
    pid = real_fork()
    forks.append(pid)
    if pid == 0 and len(forks) == 2:  # the actor: runs on only once the intermediate is gone (the scheduler's choice)
        while os.getppid() == parent:
            pass
    return pid

def record(server, env, title, fds, intermediate):
    os.write(fds[1], json.dumps({"intermediate": intermediate, "parent": os.getppid()}).encode())
    os._exit(0)

os.fork, zygote._become_actor = fork_then_wait_for_the_intermediate_to_exit, record
out_read, out_write = os.pipe()
ends = [os.open(os.devnull, os.O_RDONLY), out_write, os.open(os.devnull, os.O_WRONLY)]
server, _ = socket.socketpair()
pid = zygote._fork_actor(server, {}, "actor", ends)
print(json.dumps({"driver": os.getpid(), "actor": pid, "seen": json.loads(os.read(out_read, 4096))}))
os.waitpid(pid, 0)
"""


def test_an_actor_whose_intermediate_exits_first_still_knows_the_intermediate_pid():
    """The zygote forks an intermediate, which forks the actor and exits; the actor waits until the driver (a child
    subreaper) has adopted it. Where the intermediate exits before the actor first runs, the actor must still wait
    for the intermediate's pid to go, not for the driver's (its parent already): that wait lasted its 5 s deadline,
    a start-up in every few runs (`workers_running +4.9`)."""
    done = subprocess.run(
        [sys.executable, "-c", FORK_ACTOR_AFTER_ITS_INTERMEDIATE_EXITED],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[3],
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["seen"]["parent"] == report["driver"]  # adopted before the actor ran
    assert report["seen"]["intermediate"] not in (report["driver"], report["actor"])


def test_the_socket_directory_of_a_driver_killed_by_sigkill_is_removed_by_the_next_one(tmp_path):
    """atexit never runs under SIGKILL: each killed driver left a directory of sockets in /tmp for good; its name now
    carries the driver's pid, and the next driver sweeps those whose driver is gone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "from common.local_actors import _runtime_dir; import os, signal, sys; print(os.getpid(), _runtime_dir()); {}"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    suicide = "sys.stdout.flush(); os.kill(os.getpid(), signal.SIGKILL)"
    killed = subprocess.run([sys.executable, "-c", code.format(suicide)], capture_output=True, text=True, env=env,
                            timeout=60)  # fmt: skip
    pid, path = killed.stdout.split()
    left = Path(path)
    assert killed.returncode == -9 and left.is_dir() and left.name.startswith(f"asyncrl-actors-{pid}-")
    clean = subprocess.run([sys.executable, "-c", code.format("")], capture_output=True, text=True, env=env, timeout=60)
    assert clean.returncode == 0, clean.stderr
    assert not left.exists() and not Path(clean.stdout.split()[1]).exists()  # swept; and its own removed at exit
