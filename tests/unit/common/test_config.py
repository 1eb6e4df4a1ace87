"""Config validation: every bad input fails fast with the key named; YAML files hold overrides only."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from common.config import Config, ConfigError, all_keys, from_dict, load_config, to_dict

ROOT = Path(__file__).resolve().parents[3]
MAIN = ROOT / "configs" / "dapo_int8.yaml"


def test_defaults_and_main_config_load():
    cfg = load_config(MAIN)
    assert cfg.quant.scheme == "int8"
    assert cfg.staleness.max_lag == 2
    assert cfg.algo.filter_groups is True
    assert (cfg.loss.eps_low, cfg.loss.eps_high) == (0.2, 0.28)
    assert cfg.logging.name == "dapo_int8"


def test_overrides_apply_in_order():
    cfg = load_config(MAIN, ["train.steps=7", "loss.weighting=acr", "train.steps=9"])
    assert cfg.train.steps == 9
    assert cfg.loss.weighting == "acr"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("loss.weighting=tsi", "`loss.weighting`; valid values: none, decoupled, tis"),
        ("train.stepz=3", "unknown config key `train.stepz`; did you mean `train.steps`?"),
        ("loss.weigting=tis", "did you mean `loss.weighting`?"),
        ("gama=0.5", "did you mean `loss.acrl.gamma`?"),
        ("train.steps=abc", "bad value for `train.steps`"),
        ("train.steps=0", "`train.steps` is out of range"),
        ("rollout.top_p=1.5", "`rollout.top_p` is out of range"),
        ("quant.scheme=int4", "valid values: none, int8, fp8, fp8_trunc, w8a16, w4a16"),
        ("algo.adv=ppo", "`algo.adv`"),
        ("data.task=jsonl", "needs `data.path`"),
        ("model.path=builtin:huge", "unknown built-in model 'huge'"),
        ("model.path=/nonexistent/model", "is not a directory"),
        ("loss.dual_clip=0.5", "`loss.dual_clip`"),
        ("algo.overlong.len=99", "`algo.overlong.len`"),
        ("rollout.num_workers=0", "`rollout.num_workers`"),
        ("rollout.device=gpu", "`rollout.device` must be cpu, cuda or cuda:N, got 'gpu'"),
        ("rollout.max_seq_len=8", "`rollout.max_seq_len` (8) must exceed `rollout.max_new_tokens` (8)"),
        ("rollout.max_batch=0", "`rollout.max_batch` is out of range"),
        ("steps", "must look like key=value"),
        ("loss=tis", "`loss` is a section and must be a mapping of its keys"),
        ("loss.acrl=2", "`loss.acrl` is a section"),
        ("ray.worker_resources={rollout_node: 0}", "`ray.worker_resources.rollout_node` must be a positive amount"),
        ("rollout.max_restarts=-1", "`rollout.max_restarts` is out of range"),
        ("optim.lr=nan", "value nan for `optim.lr` is not a finite number"),
        ("loss.cap=inf", "value inf for `loss.cap` is not a finite number"),
        ("buffer.lease_timeout_s=nan", "`buffer.lease_timeout_s` is not a finite number"),
        ("loss.tbpo.delta_low=2", "`loss.tbpo.delta_low` is out of range"),
        ("staleness.max_lag=4294967296", "`staleness.max_lag` is out of range"),
        ("buffer.reserve_mb=4096", "`buffer.reserve_mb` is out of range"),
        ("precision.loss_scale_init=3", "`precision.loss_scale_init` must be a power of two"),
        ("rollout.num_workers=15", "= 8.5 CPUs > the local cluster's 8 (`ray.num_cpus` 2 x `ray.local_oversubscribe`"),
        ("ray.local_oversubscribe=0.5", "`ray.local_oversubscribe` is out of range"),
        ("quant.lm_head=int8", "`quant.lm_head`; valid values: auto, quantized, fp32"),
        ("=3", "override '=3': `` is not a dotted key"),
        (".steps=3", "override '.steps=3': `.steps` is not a dotted key"),
        ("train..steps=3", "`train..steps` is not a dotted key"),
        ("loss.cap=" + "9" * 5000, "override `loss.cap=...`: the value cannot be read (Exceeds the limit"),
        ("train.seed=4294967296", "value 4294967296 for `train.seed` is out of range [0, 4294967295]"),
        ("train.seed=-1", "`train.seed` is out of range"),
        ("data.seed=99999999999999999999999", "`data.seed` is out of range"),
        ("logging.name=../../etc", "`logging.name` is the run's directory name under `logging.dir`, not a path"),
        ("logging.name=a/b", "not a path: got 'a/b'"),
        ("logging.name=..", "not a path: got '..'"),
        ("rollout.threads=100000", "`rollout.threads` is out of range"),  # torch's set_num_threads: SIGSEGV
        ("learner.threads=99999999999999999999", "`learner.threads` is out of range"),
        ("learner.threads_max=100000", "`learner.threads_max` is out of range"),
    ],
)
def test_bad_overrides_name_the_key(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(MAIN, [override])
    assert expected in str(err.value)


def test_loss_cap_left_null_is_the_weighting_s_default_c() -> None:
    """ALGORITHMS.md: `acrl` defaults to C = 3 (the ACRL paper's clip value), every other weighting to 2; a cap that is
    set wins, and the null survives the hand-off to the learner's process (resolved where it is read)."""
    for weighting, expected in (("acrl", 3.0), ("tis", 2.0), ("mis_token", 2.0)):
        cfg = load_config("configs/dapo_int8.yaml", [f"loss.weighting={weighting}"])
        assert cfg.loss.cap is None and cfg.loss.effective_cap == expected, weighting
        assert from_dict(to_dict(cfg)).loss.effective_cap == expected, weighting
    assert load_config("configs/dapo_int8.yaml", ["loss.weighting=acrl", "loss.cap=2.5"]).loss.effective_cap == 2.5
    for bad in ("0.5", "1e300"):  # 1e300 passed and then failed the step: no float32 clamp takes it
        with pytest.raises(ConfigError, match=r"loss\.cap.*out of range"):
            load_config("configs/dapo_int8.yaml", [f"loss.cap={bad}"])


def test_overlong_shaping_is_refused_for_multi_turn_episodes() -> None:
    """An episode's model tokens span turns, each bounded by `rollout.max_new_tokens`: the shaping's window against
    that L_max would punish a correct multi-turn answer for its total length (3 points at 24 tokens of L_max 16)."""
    with pytest.raises(ConfigError, match=r"`algo.overlong.len` shapes one response's length.*env.fn"):
        load_config("configs/arith_tool.yaml", ["algo.overlong.len=4"])
    assert load_config("configs/arith_tool.yaml").algo.overlong.len == 0


def test_bad_yaml_files(tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("train:\n  step: 3\n")
    with pytest.raises(ConfigError, match=r"typo.yaml: unknown config key `train.step`; did you mean `train.steps`"):
        load_config(typo)
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="cannot parse YAML"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="scalar.yaml: cannot parse YAML"):
        load_config(scalar)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match=f"config file '{tmp_path}' is a directory"):
        load_config(tmp_path)


def test_round_trip_through_dict():
    cfg = load_config(MAIN, ["loss.acrl.gamma=0.5"])
    again = from_dict(to_dict(cfg))
    assert again == cfg


def _field_docstrings(schema: type) -> dict[str, str | None]:
    """Each field declared in the class body of `schema` -> the string statement right after it (None: none)."""
    source = textwrap.dedent(inspect.getsource(schema))
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str | None] = {}
    for statement, following in zip(body, [*body[1:], None]):
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            is_doc = isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            docs[statement.target.id] = following.value.value if is_doc else None  # type: ignore[union-attr]
    return docs


def _leaf_sections(node: type = Config, prefix: str = "") -> dict[str, type]:
    """Every dotted leaf key -> the dataclass that declares it."""
    owners: dict[str, type] = {}
    for f in dataclasses.fields(node):
        section = f.default_factory if f.default_factory is not dataclasses.MISSING else None
        if isinstance(section, type) and dataclasses.is_dataclass(section):
            owners.update(_leaf_sections(section, f"{prefix}{f.name}."))
        else:
            owners[f"{prefix}{f.name}"] = node
    return owners


def test_every_key_has_a_docstring_line():
    owners = _leaf_sections()
    assert sorted(owners) == sorted(all_keys())
    for key, schema in owners.items():
        doc = _field_docstrings(schema).get(key.rsplit(".", 1)[-1])
        assert isinstance(doc, str) and doc.strip(), f"`{key}` ({schema.__name__}) has no docstring line under it"


def test_the_docstring_check_finds_a_missing_docstring():
    @dataclasses.dataclass
    class Documented:
        steps: int = 1
        """Learner steps."""
        lr: float = 0.1
        seed: int = 0
        """Seed."""

    assert _field_docstrings(Documented) == {"steps": "Learner steps.", "lr": None, "seed": "Seed."}


def test_cli_rejects_bad_weighting_before_starting_anything():
    """The config is checked before torch, Ray or a run directory: `test_config_import_stays_light` covers the
    imports; start-up speed is not asserted here (a wall-clock bound fails on a busy machine)."""
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "up", str(MAIN), "loss.weighting=tsi"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "loss.weighting" in proc.stderr and "tis" in proc.stderr
    assert "Traceback" not in proc.stderr and not (MAIN.parent / "runs").exists()


def test_config_import_stays_light():
    code = "import sys, asyncrl.cli, common.config; print(any(m in sys.modules for m in ('torch', 'ray', 'zmq')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


BAD_CONFIGS = sorted((Path(__file__).parents[2] / "data" / "bad_configs").glob("*.yaml"))


def test_the_invalid_config_corpus_is_large():
    assert len(BAD_CONFIGS) >= 30


@pytest.mark.parametrize("path", BAD_CONFIGS, ids=lambda p: p.stem)
def test_every_invalid_config_is_rejected_naming_the_key(path):
    """Each file's first line says what the error must name: `# expect: <text>`."""
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), path
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert first.removeprefix("# expect: ") in str(err.value)


def test_a_section_is_checked_against_the_bounds_declared_with_its_fields():
    from common.config import AlgoConfig, BufferConfig, OverlongConfig, check_section

    check_section(BufferConfig(), "buffer.")
    with pytest.raises(ConfigError, match=r"invalid value 'sometimes' for `buffer.fsync`; valid values: always, batch"):
        check_section(BufferConfig(fsync="sometimes"), "buffer.")
    with pytest.raises(ConfigError, match=r"value -1 for `algo.overlong.len` is out of range \[0, inf\]"):
        check_section(AlgoConfig(overlong=OverlongConfig(len=-1)), "algo.")
    with pytest.raises(ConfigError, match="value nan for `buffer.lease_timeout_s` is not a finite number"):
        check_section(BufferConfig(lease_timeout_s=float("nan")), "buffer.")


def test_a_live_change_to_a_non_finite_value_is_refused():
    from common.config import live_update

    cfg = load_config(MAIN)
    for item in ("optim.lr=nan", "loss.cap=inf", "loss.eps_high=-inf"):
        with pytest.raises(ConfigError, match="not a finite number"):
            live_update(cfg, [item])
    assert live_update(cfg, ["optim.lr=3e-4"]) == {"optim.lr": 3e-4}


def test_an_aligned_learner_with_weight_only_rollout_needs_fp32_rollout():
    aligned = ["learner.rollout_aligned=true", "quant.scheme=w4a16"]
    with pytest.raises(ConfigError, match=r"needs `precision.rollout=fp32` \(the engine would compute in bf16"):
        load_config(MAIN, [*aligned, "precision.rollout=bf16"])
    assert load_config(MAIN, [*aligned, "precision.rollout=fp32"]).quant.scheme == "w4a16"


def test_the_lm_head_is_quantized_where_the_engine_runs_it():
    from common.config_rules import head_quantized

    def resolved(*overrides: str) -> bool:
        cfg = load_config(MAIN, list(overrides))
        return head_quantized(cfg.quant, cfg.rollout)

    assert resolved() and resolved("quant.scheme=fp8")  # auto: W8A8 on the embedded engine
    assert not resolved("quant.scheme=w4a16") and not resolved("quant.scheme=none")
    assert resolved("quant.scheme=w4a16", "quant.lm_head=quantized") and not resolved("quant.lm_head=fp32")
    assert not resolved("rollout.backend=sglang", "quant.scheme=fp8", "rollout.sglang.launcher=asyncrl")
    with pytest.raises(ConfigError, match="SGLang serves the LM head unquantized"):
        load_config(MAIN, ["rollout.backend=sglang", "quant.scheme=fp8", "quant.lm_head=quantized"])
    with pytest.raises(ConfigError, match="`quant.lm_head=quantized` needs a quantized `quant.scheme`"):
        load_config(MAIN, ["quant.scheme=none", "quant.lm_head=quantized"])


def test_a_map_given_whole_on_the_command_line_replaces_the_files_and_a_dotted_key_merges_into_it() -> None:
    """`env.args={...}` was merged into configs/arith_tool.yaml's map: the user's environment got `syntax=brackets`
    and its constructor raised on every episode."""
    from common.config import load_config

    path = Path(__file__).resolve().parents[3] / "configs" / "arith_tool.yaml"
    assert load_config(path, []).env.args == {"syntax": "brackets"}
    assert load_config(path, ["env.args={mode: x, size: 3}"]).env.args == {"mode": "x", "size": 3}
    assert load_config(path, ["env.args={}"]).env.args == {}
    assert load_config(path, ["env.args.size=3"]).env.args == {"syntax": "brackets", "size": 3}


def test_chat_template_true_and_false_as_yaml_booleans(tmp_path):
    """`data.chat_template=false` (documented, and advised by the refusal of a tokenizer without a template) arrived as
    the string 'False' and was refused: valid values auto, true, false."""
    assert load_config(None, ["data.chat_template=false"]).data.chat_template == "false"
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  chat_template: true\n")
    assert load_config(str(path), []).data.chat_template == "true"
    with pytest.raises(ConfigError, match="invalid value 'maybe' for `data.chat_template`"):
        load_config(None, ["data.chat_template=maybe"])


def test_a_reward_function_beside_an_environment_is_refused():
    """Episodes are scored by their environment: `reward.fn` with `env.fn` was loaded and never called."""
    base = ["env.fn=asyncrl:arith_tool", "data.task=arith_tool", "model.path=builtin:tiny-tool", "algo.overlong.len=0"]
    for extra, key in ((["reward.fn=asyncrl:arith"], "reward.fn"), (["reward.fns=[asyncrl:arith]"], "reward.fns")):
        with pytest.raises(ConfigError, match=f"^`{key}` is not used with `env.fn`: an episode's reward is its env"):
            load_config(None, base + extra)
    assert load_config(None, base).env.fn == "asyncrl:arith_tool"


def test_a_list_for_a_mapping_or_the_reverse_is_named(tmp_path):
    """omegaconf raised a bare TypeError ("Cannot merge incompatible container types"): a traceback, exit code 1."""
    with pytest.raises(ConfigError, match=r"override 'env.args=\[1,2\]': `env.args` must be a mapping, got a list"):
        load_config(None, ["env.args=[1,2]"])
    with pytest.raises(ConfigError, match=r"`model.lora.targets` must be a list, got a mapping: \{'q_proj': 1\}"):
        load_config(None, ["model.lora.targets={q_proj: 1}"])
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  lora:\n    targets: {q_proj: 1}\n")
    with pytest.raises(ConfigError, match=r"c.yaml: `model.lora.targets` must be a list, got a mapping"):
        load_config(str(path), [])


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("trian.steps=5", "unknown config key `trian`; did you mean `train.steps`?"),  # said `precision.train`
        ("qaunt.scheme=fp8", "unknown config key `qaunt`; did you mean `quant.scheme`?"),  # said nothing
        ("lss.cap=3", "unknown config key `lss`; did you mean `loss.cap`?"),
        ("trian.stesp=4", "unknown config key `trian`; did you mean section `train`?"),
    ],
)
def test_a_misspelled_section_gets_the_key_it_meant(override, suggestion):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    assert str(caught.value).endswith(suggestion)


def test_a_misspelled_section_in_a_file_gets_the_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("rollot:\n  top_p: 0.9\n")
    with pytest.raises(ConfigError, match=r"unknown config key `rollot`; did you mean `rollout`\?$"):
        load_config(str(path), [])  # said `rollout.top_p`


def test_a_resume_may_not_change_the_lora_base_its_adapter_was_trained_on() -> None:
    from common.config import resume_changes

    saved = load_config(ROOT / "configs" / "dapo_int8_lora.yaml", [])
    assert resume_changes(saved, load_config(ROOT / "configs" / "dapo_int8_lora.yaml", ["learner.lora_base=full"])) == [
        "learner.lora_base"
    ]
    assert resume_changes(saved, load_config(ROOT / "configs" / "dapo_int8_lora.yaml", ["train.steps=7"])) == []


def test_continuous_rollout_needs_the_embedded_engine_and_single_turn_rollout() -> None:
    with pytest.raises(ConfigError, match="`rollout.continuous=true` needs `rollout.backend=embedded`"):
        load_config(None, ["rollout.continuous=true", "rollout.backend=sglang", "quant.scheme=fp8"])
    with pytest.raises(ConfigError, match="`rollout.continuous=true` is for single-turn rollout"):
        load_config(None, ["rollout.continuous=true", "env.fn=builtin:arith_tool"])
    assert load_config(None, ["rollout.continuous=true"]).rollout.continuous
