"""`rollout.backend: sglang` with `asyncrl serve` servers in real subprocesses: the Engine protocol over HTTP, weight
updates through pause / update_weights_from_disk / continue with per-token versions, and the supervisor."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from common.builtin_model import resolve_model_path
from common.config import load_config
from quant_sync.export import export_rollout_tensors
from quant_sync.update import WeightUpdate
from rollout_workers.engine import SamplingParams
from rollout_workers.sections import EngineSections
from rollout_workers.sglang_api.backend import SGLangEngine
from rollout_workers.sglang_api.checkpoint import read_tensors

PROMPT = [3, 4, 10, 5, 12]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model_path("builtin:micro", log=lambda *a: None))


def version(model_dir: str, number: int) -> WeightUpdate:
    floats = {name: tensor.to(torch.float32) for name, tensor in read_tensors(model_dir).items()}
    torch.manual_seed(number)
    nudged = {
        name: t + 0.3 * number * torch.randn_like(t) * t.std() if t.dim() == 2 else t for name, t in floats.items()
    }
    return WeightUpdate(number, export_rollout_tensors(nudged, "int8"), "int8")


def backend(model_dir: str, tmp_path, *overrides: str) -> SGLangEngine:
    cfg = load_config(
        None,
        [
            "model.path=builtin:micro",
            "rollout.backend=sglang",
            "rollout.sglang.launcher=asyncrl",
            f"rollout.sglang.ckpt_dir={tmp_path}",
            "rollout.sglang.startup_timeout_s=120",
            *overrides,
        ],
    )
    return SGLangEngine(EngineSections.pick(cfg), model_dir, worker_id="worker-0", seed=0)


def wait_version(engine: SGLangEngine, number: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.version < number:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.05)


def generate_across_update(engine: SGLangEngine, model_dir: str, number: int, n: int = 4) -> list:
    """Generate n long samples; publish version `number` while they run (the server slowed to 20 ms a step)."""
    engine._client.request("POST", "/slow_down", {"forward_sleep_time": 0.02})
    staging = threading.Timer(0.3, lambda: engine.stage_weights(version(model_dir, number)))
    staging.start()
    try:
        return engine.generate([PROMPT] * n, SamplingParams(max_new_tokens=40, stop_token_ids=(-1,)))
    finally:
        staging.join()
        engine._client.request("POST", "/slow_down", {"forward_sleep_time": None})


def test_a_sync_thread_that_fails_ends_generation_with_its_error(model_dir, tmp_path):
    """Any failure the sync thread does not handle (here a version that cannot be applied) makes the engine fatal:
    generation raises it (the worker is restarted) instead of waiting for a sync that will never come (before: the
    thread died silently and generate() waited out `startup_timeout_s`, or its samplers retried for ever)."""
    engine = backend(model_dir, tmp_path, "rollout.sglang.max_restarts=0", "rollout.sglang.startup_timeout_s=60")

    def apply_fails(version: int, path) -> None:
        raise KeyError(f"no tensor for version {version}")

    engine._apply = apply_fails  # type: ignore[method-assign]
    try:
        engine.stage_weights(version(model_dir, 0))
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"the SGLang sync thread failed \(KeyError: 'no tensor for version 0'"):
            engine.generate([PROMPT], SamplingParams(max_new_tokens=3, stop_token_ids=(-1,)))
        assert time.monotonic() - started < 45 and "KeyError" in engine.fatal
    finally:
        engine.close()


@pytest.mark.slow  # two server starts (launch, relaunch): 20-35 s on 2 shared cores
def test_abort_mode_resubmits_a_dead_server_is_relaunched_and_one_past_max_restarts_fails(model_dir, tmp_path):
    engine = backend(model_dir, tmp_path, "rollout.sglang.pause_mode=abort", "rollout.sglang.max_restarts=1")
    try:
        engine.stage_weights(version(model_dir, 0))
        wait_version(engine, 0)
        completions = generate_across_update(engine, model_dir, 1)
        for completion in completions:  # aborted by the pause, resubmitted with their tokens, finished on version 1
            assert completion.finish == "length" and len(completion.response_ids) == 40
            assert len(completion.behav_logp) == 40 and all(lp <= 0 for lp in completion.behav_logp)
            switch = completion.versions.index(1)
            assert switch > 0 and completion.versions == [0] * switch + [1] * (40 - switch)
        stats = engine.stats()
        assert stats["sglang_resubmitted"] >= 4 and stats["sglang_weight_updates"] == 2
        assert 0 < stats["sglang_pause_s_last"] <= stats["sglang_pause_s_max"] < 30
        # the server dies: the supervisor relaunches it from the newest checkpoint, generation goes on
        os.kill(engine.server_pid, signal.SIGKILL)
        (after,) = engine.generate([PROMPT], SamplingParams(max_new_tokens=5, stop_token_ids=(-1,)))
        assert after.finish == "length" and after.versions == [1] * 5
        assert engine.stats()["sglang_server_restarts"] == 1 and engine.version == 1
        # and dies again, past rollout.sglang.max_restarts=1: generation fails clearly instead of waiting forever
        os.kill(engine.server_pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"SGLang server failed 2 times \(rollout.sglang.max_restarts\)"):
            engine.generate([PROMPT], SamplingParams(max_new_tokens=5, stop_token_ids=(-1,)))
        assert time.monotonic() - started < 30
    finally:
        pid = engine.server_pid
        engine.close()
    assert not engine.root.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize("mode", ["retract"])
def test_in_flight_modes_tag_every_token_with_its_version(model_dir, tmp_path, mode):
    engine = backend(model_dir, tmp_path, f"rollout.sglang.pause_mode={mode}")
    try:
        engine.stage_weights(version(model_dir, 0))
        wait_version(engine, 0)
        completions = generate_across_update(engine, model_dir, 1)
        assert engine.stats()["sglang_resubmitted"] == 0  # nothing was aborted: the requests stayed in flight
        for completion in completions:
            switch = completion.versions.index(1)
            assert switch > 0 and completion.versions == [0] * switch + [1] * (40 - switch)
        # the logprobs of one seeded sample are those of the engine's own generate on the same weights
        from rollout_workers.embedded.engine import EmbeddedEngine

        reference = EmbeddedEngine(model_dir, max_batch=2)
        reference.stage_weights(version(model_dir, 1))
        params = SamplingParams(max_new_tokens=8, stop_token_ids=(-1,), seed=5)
        (served,) = engine.generate([PROMPT], params)
        (local,) = reference.generate([PROMPT], params)
        assert served.response_ids == local.response_ids
        assert served.behav_logp == pytest.approx(local.behav_logp, abs=1e-5)
        # an abort the worker did not ask for (here /abort_request): the samples are resubmitted and complete
        engine._client.request("POST", "/slow_down", {"forward_sleep_time": 0.02})
        aborter = threading.Timer(0.3, lambda: engine._client.abort(abort_all=True))
        aborter.start()
        retried = engine.generate([PROMPT] * 2, SamplingParams(max_new_tokens=30, stop_token_ids=(-1,)))
        aborter.join()
        assert [c.finish for c in retried] == ["length", "length"] and all(len(c.versions) == 30 for c in retried)
        assert engine.stats()["sglang_resubmitted"] == 2
        check_timed_out_requests_are_aborted_and_end_the_sample(engine)
        check_the_server_wants_the_worker_s_key(engine)
    finally:
        engine.close()


def test_in_place_updates_keep_the_kv_and_do_not_ask_sglang_for_the_flush_that_ends_it(model_dir, tmp_path):
    """SGLang 0.5.9 keeps `in_place`'s running requests in its batch: the cache flush of a weight update (its
    default) then fails, an assertion ends its scheduler and the server dies (scheduler_update_weights_mixin.py). The
    worker asked for that flush at every update; the stand-in now dies as SGLang does."""
    engine = backend(model_dir, tmp_path, "rollout.sglang.pause_mode=in_place", "rollout.sglang.max_restarts=0")
    try:
        engine.stage_weights(version(model_dir, 0))
        wait_version(engine, 0)
        completions = generate_across_update(engine, model_dir, 1)  # no flush asked: the server lives on
        assert engine.stats()["sglang_server_restarts"] == 0 and not engine.fatal
        assert all(c.finish == "length" and c.versions[-1] == 1 for c in completions)
        client, path = engine._client, str(engine._launch_dir)
        client.request("POST", "/slow_down", {"forward_sleep_time": 0.02})

        def generate_long() -> None:  # answered 500 (or its connection dropped) as the server ends
            with contextlib.suppress(Exception):
                client.request(
                    "POST",
                    "/generate",
                    {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 50, "ignore_eos": True}},
                )

        running = threading.Thread(target=generate_long, daemon=True)
        running.start()
        time.sleep(0.3)
        client.pause("in_place")
        with pytest.raises(Exception):  # noqa: B017 - the server answers 500 or drops the connection as it ends
            client.update_weights_from_disk(path, weight_version="2")  # SGLang's default: flush_cache true
        engine._server.proc.wait(timeout=30)  # the server ended, as SGLang's does
    finally:
        engine.close()


def test_the_stop_tokens_sent_to_sglang_follow_its_ignore_eos_rule():
    """SGLang 0.5.9's ignore_eos turns off every token stop, stop_token_ids included: every request of the worker
    went out with it (its stop ids are the EOS ids) and would have run to max_new_tokens on a real server."""
    sampling = SGLangEngine._sampling
    for stop_ids, sent, ignore in (((2,), [2], False), ((), [], False), ((-1,), [], True), ((2, 7), [2, 7], False)):
        values = sampling(None, SamplingParams(max_new_tokens=5, stop_token_ids=stop_ids), 5, 0, [])  # type: ignore[arg-type]
        assert (values["stop_token_ids"], values["ignore_eos"]) == (sent, ignore), stop_ids


def check_timed_out_requests_are_aborted_and_end_the_sample(engine: SGLangEngine) -> None:
    """A /generate that outlasts `request_timeout_s` was resubmitted without end while the server kept running each
    copy: now each is aborted by its rid and counts against `max_retries` (2), then the sample ends as an abort."""
    client = engine._client
    client.request("POST", "/slow_down", {"forward_sleep_time": 0.06})  # 50 tokens: 3 s a request
    client.timeout_s, before = 0.4, engine.stats()
    results: list = []
    thread = threading.Thread(
        target=lambda: results.append(
            engine.generate([PROMPT], SamplingParams(max_new_tokens=50, stop_token_ids=(-1,)))
        )
    )
    thread.start()
    thread.join(timeout=30)
    client.timeout_s = 600.0
    try:
        assert not thread.is_alive(), "a request that always times out was resubmitted without end"
        ((late,),) = results
        assert late.finish == "abort"
        stats = engine.stats()
        assert stats["sglang_timed_out_requests"] - before["sglang_timed_out_requests"] == 3
        assert stats["sglang_aborted_samples"] - before["sglang_aborted_samples"] == 1
        deadline = time.monotonic() + 2.0  # unaborted, the last copy would run about 2.5 s more
        while client.request("GET", "/get_load")[0]["num_reqs"]:
            assert time.monotonic() < deadline, "the timed-out requests still run on the server"
            time.sleep(0.05)
    finally:
        client.request("POST", "/slow_down", {"forward_sleep_time": None})


def check_the_server_wants_the_worker_s_key(engine: SGLangEngine) -> None:
    """Any local process could pause the server's generation, relabel its weight version or load other weights:
    the worker's server now wants its key (SGLang's --api-key), handed over in a 0600 file, not on its command line."""
    import os
    import stat

    import requests

    url = engine._client.base_url
    for path, body in (("/pause_generation", {"mode": "in_place"}), ("/update_weight_version", {"new_version": "9"})):
        refused = requests.post(url + path, json=body, timeout=30)
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"}), path
        wrong = requests.post(url + path, json=body, timeout=30, headers={"Authorization": "Bearer not-the-key"})
        assert wrong.status_code == 401, path
    assert requests.get(url + "/health", timeout=30).status_code == 200  # as SGLang: health needs no key
    assert engine._client.weight_version() != "9"
    key_file = engine._api_key_file
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and key_file.read_text() == engine._api_key
    cmdline = Path(f"/proc/{engine._server.proc.pid}/cmdline").read_bytes().decode()  # what `ps` shows others
    assert engine._api_key not in cmdline and str(key_file) in cmdline and os.path.isfile(key_file)


def test_real_sglang_command_and_the_int8_reload_refusal():
    from common.config import ConfigError
    from rollout_workers.sglang_api.backend import server_command

    with pytest.raises(ConfigError, match="w8a8_int8.*quant.scheme=fp8"):
        load_config(None, ["rollout.backend=sglang", "quant.scheme=int8"])
    with pytest.raises(ConfigError, match="loopback"):
        load_config(None, ["rollout.backend=sglang", "quant.scheme=fp8", "rollout.sglang.host=0.0.0.0"])
    cfg = load_config(
        None,
        [
            "rollout.backend=sglang",
            "quant.scheme=fp8",
            "rollout.sglang.tp=2",
            "rollout.sglang.mem_fraction_static=0.7",
            "rollout.sglang.extra_args=[--log-level,error]",
        ],
    )
    command = server_command(EngineSections.pick(cfg), "/ckpt/v3", 30001, "3", seed=7)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    flags = dict(zip(command[3:-2:2], command[4:-2:2]))
    assert flags == {
        "--model-path": "/ckpt/v3",
        "--host": "127.0.0.1",
        "--port": "30001",
        "--tp": "2",
        "--mem-fraction-static": "0.7",
        "--weight-version": "3",
        "--random-seed": "7",
        "--quantization": "fp8",
    }
    assert command[-2:] == ["--log-level", "error"]
    keyed = server_command(EngineSections.pick(cfg), "/ckpt/v3", 30001, "3", seed=7, api_key_file=Path("/r/api_key"))
    assert dict(zip(keyed[3:-2:2], keyed[4:-2:2]))["--config"] == "/r/api_key.yaml"  # SGLang reads --api-key there


@pytest.mark.parametrize("scheme", ["int8", "fp8", "none"])
def test_checkpoint_layouts_round_trip(model_dir, tmp_path, scheme):
    import json

    from rollout_workers.sglang_api.checkpoint import (
        checkpoint_scheme,
        rollout_tensors,
        sglang_tensors,
        write_version_dir,
    )

    published = (
        version(model_dir, 2)
        if scheme == "int8"
        else WeightUpdate(
            2, export_rollout_tensors({k: v.float() for k, v in read_tensors(model_dir).items()}, scheme), scheme
        )
    )
    path = write_version_dir(tmp_path, "v2", sglang_tensors(published), model_dir, scheme)
    on_disk = read_tensors(path)
    config = json.loads((path / "config.json").read_text())
    linear = "model.layers.0.mlp.down_proj.weight"
    if scheme == "int8":  # w8a8_int8: int8 weight + (out, 1) weight_scale, the very values published
        assert config["quantization_config"] == {"quant_method": "w8a8_int8"}
        assert on_disk[linear].dtype == torch.int8 and on_disk[linear + "_scale"].shape[1] == 1
        assert torch.equal(rollout_tensors(on_disk, "int8")[linear], published.tensors[linear])
    elif scheme == "fp8":  # block FP8: e4m3 weight + weight_scale_inv per 128x128 block
        assert config["quantization_config"]["weight_block_size"] == [128, 128]
        assert (
            on_disk[linear].dtype == torch.float8_e4m3fn and "model.layers.0.mlp.down_proj.weight_scale_inv" in on_disk
        )
        served = rollout_tensors(on_disk, "fp8")
        rows = published.tensors[linear].float() * published.tensors[linear + "_scale"][:, None]
        back = served[linear].float() * served[linear + "_scale"][:, None]
        assert (back - rows).norm() / rows.norm() < 0.1
    else:
        assert "quantization_config" not in config and on_disk[linear].dtype == torch.float32
    assert checkpoint_scheme(path)[0] == scheme
    assert (path / "tokenizer.json").is_file()


@pytest.mark.parametrize("recipe", ["dapo_fp8_qwen2.5_7b.yaml", "dapo_int8_qwen2.5_7b.yaml"])
def test_gpu_recipes_are_valid_configs(recipe):
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "configs" / recipe
    cfg = load_config(path, ["model.path=builtin:micro"])  # the recipes name a local 7B directory
    assert cfg.quant.scheme in ("fp8", "int8") and cfg.precision.rollout == "bf16"
    assert (cfg.rollout.backend == "sglang") == (cfg.quant.scheme == "fp8")  # SGLang cannot reload w8a8_int8
    assert (cfg.learner.device, cfg.learner.world_size) == ("cuda:4", 4)  # the learner on GPUs 4-7, past the rollout


def test_the_longest_request_the_server_takes_is_known_to_the_worker(model_dir):
    """None made the worker send every prompt; SGLang 0.5.9 answers 400 to input + max_new_tokens >= its context
    length, which failed the worker's whole batch. Now a prompt that cannot fit is skipped and counted."""
    from types import SimpleNamespace

    from rollout_workers.embedded.arch import ArchConfig

    arch = ArchConfig.from_model_dir(model_dir)
    limit = SGLangEngine.max_seq_len.fget  # type: ignore[attr-defined]
    for launcher, extra, expected in (
        ("sglang", [], arch.max_positions - 1),
        ("sglang", ["--context-length", "40"], 39),
        ("sglang", ["--context-length=48"], 47),
        ("asyncrl", [], min(2048, arch.max_positions)),
    ):
        cfg = load_config(None, ["model.path=builtin:micro", f"rollout.sglang.extra_args={extra}"])
        sections = EngineSections.pick(cfg)
        engine = SimpleNamespace(arch=arch, sg=replace(sections.rollout.sglang, launcher=launcher), sections=sections)
        assert limit(engine) == expected, (launcher, extra)
