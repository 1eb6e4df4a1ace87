"""`asyncrl probe`: real engine sampling with each scheme's weights, real learner forward, real per-layer scan."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from asyncrl import cli
from asyncrl.probe import ProbeError, ProbeOptions, parse_schemes, run_probe
from asyncrl.probe_measure import FP32_FLOOR_LOG_RATIO
from common.builtin_model import resolve_model_path

SCHEMES = ("none", "int8", "fp8", "w8a16", "w4a16")


def _quiet(*_args) -> None:
    pass


@pytest.fixture(scope="module")
def micro_dir() -> str:
    return str(resolve_model_path("builtin:micro", log=_quiet))


@pytest.fixture(scope="module")
def builtin_result() -> dict:
    options = ProbeOptions(model="builtin:micro", overrides=["rollout.max_new_tokens=12"], prompts=6, layer_rows=12)
    return run_probe(options, log=_quiet)


def _check_result(result: dict, schemes: tuple[str, ...], num_layers: int, clip_share: float) -> None:
    rows = {row["scheme"]: row for row in result["schemes"]}
    assert [row["scheme"] for row in result["schemes"]] == list(schemes)  # one row per scheme, in the order asked
    none = rows["none"]
    # fp32 rollout: no mismatch beyond fp32 rounding (the engine's decode and the learner's forward sum in different
    # orders; the learner disagrees with itself across batch shapes by as much: `floor`)
    assert none["max_abs_log_ratio"] < FP32_FLOOR_LOG_RATIO
    assert abs(none["metrics"]["kl_k3"]) < 1e-9 and none["metrics"]["w_max"] < 1.0 + FP32_FLOOR_LOG_RATIO
    assert none["recommend"]["weighting"] == "decoupled" and not none["layers"]
    assert result["floor"]["max_abs_log_ratio"] < FP32_FLOOR_LOG_RATIO
    int8 = rows["int8"]
    assert int8["metrics"]["kl_k3"] > 0 and int8["max_abs_log_ratio"] > FP32_FLOOR_LOG_RATIO
    for row in result["schemes"]:
        metrics, weights = row["metrics"], row["weight_quantiles"]
        assert row["tokens"] > 0 and row["responses"] == result["prompts"] * result["group_size"]
        assert weights["q1"] == pytest.approx(metrics["w_max"], rel=1e-6)  # the quantiles are of the same w
        log_ratio = row["log_ratio_quantiles"]
        assert log_ratio["q0"] <= log_ratio["q0.5"] <= log_ratio["q1"]
        rec = row["recommend"]
        assert rec["cap"] >= 1.0 and rec["clipped_at_cap"] <= clip_share  # clips at most the share asked for
        if clip_share == 0.01:
            assert rec["cap"] >= weights["q0.99"] - 1e-9
        if row["scheme"] != "none":
            layers = row["layers"]
            assert sorted(layer["layer"] for layer in layers) == list(range(num_layers))
            kls = [layer["kl_k3"] for layer in layers]
            assert kls == sorted(kls, reverse=True)  # worst layer first
            assert row["aligned_all_kl_k3"] > 0


def test_probe_builtin_model_reports_every_scheme(builtin_result):
    _check_result(builtin_result, SCHEMES, num_layers=2, clip_share=0.01)
    assert builtin_result["task"] == "arith" and builtin_result["max_new_tokens"] == 12


def test_probe_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "probe" / "micro.json"
    argv = ["probe", "builtin:micro", "rollout.max_new_tokens=8", "train.group_size=4", "--prompts", "4",
            "--schemes", "none,int8", "--clip-share", "0.05", "--layers-top", "1", "--layer-schemes", "int8",
            "--json", str(out)]  # fmt: skip
    code = cli.main(argv)
    assert code == 0
    printed = capsys.readouterr().out
    assert "none" in printed and "int8" in printed and "loss.cap=" in printed and "fp32 floor" in printed
    result = json.loads(out.read_text())
    assert [row["scheme"] for row in result["schemes"]] == ["none", "int8"] and result["group_size"] == 4
    _check_result(result, ("none", "int8"), num_layers=2, clip_share=0.05)


def test_probe_random_init_hf_llama_directory(tmp_path, micro_dir):
    """A user's Hugging Face directory (random init, a tokenizer of its own vocabulary) goes through the same path."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(micro_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model_dir = tmp_path / "llama"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    options = ProbeOptions(model=str(model_dir), overrides=["rollout.max_new_tokens=10", "train.group_size=4"],
                           schemes=("none", "int8", "w4a16"), prompts=4, layer_rows=8)  # fmt: skip
    result = run_probe(options, log=_quiet)
    _check_result(result, ("none", "int8", "w4a16"), num_layers=3, clip_share=0.01)


def test_probe_bad_input_names_what_is_wrong(tmp_path, micro_dir, capsys):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ProbeError, match="no-such-model"):
        run_probe(ProbeOptions(model=str(missing), overrides=[]), log=_quiet)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ProbeError, match="no config.json"):
        run_probe(ProbeOptions(model=str(empty), overrides=[]), log=_quiet)
    no_tokenizer = tmp_path / "no-tokenizer"
    no_tokenizer.mkdir()
    shutil.copy(f"{micro_dir}/config.json", no_tokenizer / "config.json")
    with pytest.raises(ProbeError, match="no tokenizer"):
        run_probe(ProbeOptions(model=str(no_tokenizer), overrides=[]), log=_quiet)
    with pytest.raises(ProbeError, match="unknown built-in model"):
        run_probe(ProbeOptions(model="builtin:huge", overrides=[]), log=_quiet)
    with pytest.raises(ProbeError, match="model.path"):
        run_probe(ProbeOptions(model="builtin:micro", overrides=["model.path=builtin:tiny"]), log=_quiet)
    with pytest.raises(ProbeError, match="rollout.max_new_token"):
        run_probe(ProbeOptions(model="builtin:micro", overrides=["rollout.max_new_token=4"]), log=_quiet)
    for new_tokens in (60, 64):  # builtin:micro: 64 positions; the arithmetic task never ends: scanned forever
        with pytest.raises(ProbeError, match="no prompt fits the engine's 64 positions"):
            run_probe(ProbeOptions(model="builtin:micro", overrides=[f"rollout.max_new_tokens={new_tokens}"],
                                   prompts=1), log=_quiet)  # fmt: skip
    with pytest.raises(ProbeError, match=r"unknown scheme 'int4'.*none, int8"):
        parse_schemes("none,int4")
    with pytest.raises(ProbeError, match="twice"):
        parse_schemes("int8,int8")
    assert cli.main(["probe", "builtin:micro", "--schemes", "int8,nf4"]) == 2
    assert "unknown scheme 'nf4'" in capsys.readouterr().err
    assert cli.main(["probe", str(missing)]) == 2
    assert "no-such-model" in capsys.readouterr().err
    assert cli.main(["probe", "builtin:micro", "--clip-share", "1.5"]) == 2
    assert "--clip-share" in capsys.readouterr().err
    assert cli.main(["probe", "builtin:micro", "--schemes", "none,int8", "--layer-schemes", "fp8"]) == 2
    assert "--layer-schemes 'fp8'" in capsys.readouterr().err
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert cli.main(["probe", "builtin:micro", "--json", str(a_file / "probe.json")]) == 2  # before any measurement
    assert capsys.readouterr().err == f"asyncrl probe: --json {a_file / 'probe.json'}: {a_file} is not a directory\n"


def test_layer_scan_replay_equals_whole_forwards(micro_dir):
    """The scan replays the fp32 layers before the quantized one: each layer's kl_k3 is what a whole forward with
    that layer alone quantized gives, to the bit; and the model scores in fp32 again afterwards."""
    from asyncrl import probe_measure as pm
    from learner.losses import mismatch_metrics

    model = pm.load_learner_model(micro_dir, trust_remote_code=False)
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    settings = pm.EngineSettings(max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, max_batch=64, max_seq_len=64,
                                 precision="fp32", device="cpu", seed=3)  # fmt: skip
    prompts = [[1, 5, 6, 3, 7, 12], [1, 9, 4, 8, 12]]
    batch = pm.sample(micro_dir, state, "int8", prompts, 4, settings, pad_id=0).batch
    before = pm.score(model, batch, 1.0, micro_batch_tokens=48)  # several micro-batches
    scanner = pm.LayerScanner(model)
    layers, aligned_all, engine = scanner.scan("int8", batch, 1.0, 48, cap=2.0)
    assert pm.score(model, batch, 1.0, 48).equal(before)  # every layer back to fp32
    for row in layers:
        scanner.only(row["layer"])
        whole = pm.score(model, batch, 1.0, 48)
        assert row["kl_k3"] == mismatch_metrics(whole, before, batch.mask, 2.0)["mismatch/kl_k3"]
    scanner.only(-1)
    assert engine == mismatch_metrics(batch.behav_logp, before, batch.mask, 2.0)["mismatch/kl_k3"]
    assert aligned_all > 0 and max(row["kl_k3"] for row in layers) > 0


def test_the_weighting_follows_the_larger_kl_estimate():
    """kl_k1 (mean lb - lp) can come out negative on a mismatch that kl_k3 reads well above TIS_MAX_KL_K1: the
    recommendation was `tis` there (fp8 on builtin:tiny, --prompts 8: kl_k1 -0.0066, kl_k3 0.0016)."""
    from types import SimpleNamespace

    import torch

    from asyncrl.probe_measure import TIS_MAX_KL_K1, Sampled, scheme_report

    lb = torch.log(torch.full((1, 3), 0.5))
    log_w = torch.tensor([[0.3, 0.3, -0.5]])  # mean +0.033: kl_k1 = -0.033, kl_k3 = 0.069
    batch = SimpleNamespace(behav_logp=lb, mask=torch.ones_like(lb), rows=1)
    report = scheme_report("fp8", Sampled(batch, 0.0, 3, 0), lb + log_w, cap=2.0, clip_share=0.01, score_s=0.0)
    assert report.metrics["kl_k1"] < 0 < TIS_MAX_KL_K1 < report.metrics["kl_k3"]
    assert report.recommend["weighting"] == "acr" and "KL 0.069" in report.recommend["reason"]
    small = scheme_report("w8a16", Sampled(batch, 0.0, 3, 0), lb + log_w / 100, 2.0, 0.01, 0.0)
    assert small.recommend["weighting"] == "tis"
