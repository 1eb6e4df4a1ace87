"""FSDP2 across 2 learner ranks (real torch.distributed, gloo, spawned processes) = one process, to 1e-5."""

from __future__ import annotations

import multiprocessing

import psutil
import torch
import torch.multiprocessing as mp
from tiny_learner import tiny_batch, tiny_config, tiny_model, with_behavior

from learner.acrl import AcrlReference
from learner.distributed import (
    SINGLE,
    Dist,
    broadcast_batch,
    full_optimizer_state,
    full_state_dict,
    load_optimizer_state,
    local_rendezvous,
    shard_model,
    start_rendezvous,
)
from learner.fp32_gemm import OnednnLinear, use_fp32_gemm
from learner.precision import LossScaler
from learner.recompute import enable_gradient_checkpointing, is_checkpointed
from learner.update import train_on_batch

CASES = [  # (weighting, extra overrides): token-level, ACRL (Y_g over whole groups), sequence-level, another agg
    ("tis", ()),
    ("acrl", ()),
    ("tbpo", ()),
    ("none", ("loss.agg=seq_mean_token_mean",)),
    ("tis", ("learner.minibatches=1",)),  # lp from the minibatch's own forward, each rank's rows, then summed
    ("tis", ("learner.fp32_gemm=onednn",)),  # the linears' GEMMs on oneDNN (learner/fp32_gemm.py) under FSDP2
    ("tis", ("learner.gradient_checkpointing=true",)),  # each layer recomputed in backward, FSDP2's hooks outside it
]
# Two minibatches (two optimizer steps) and micro-batches of ~2 rows: the ranks run different numbers of them.
COMMON = ("learner.minibatches=2", "learner.micro_batch_tokens=26", "optim.grad_clip=0.5", "learner.fp32_gemm=blas")


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a full copy of every gradient it applies (gathered from the shards under FSDP2)."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.applied: list[list[torch.Tensor]] = []

    def step(self, closure=None):  # noqa: ANN001, ANN201
        grads = [p.grad for group in self.param_groups for p in group["params"]]
        self.applied.append([(g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone() for g in grads])
        return super().step(closure)


def run_case(weighting: str, extra: tuple[str, ...], ranks: Dist) -> dict[str, object]:
    model = tiny_model(seed=5)
    batch = with_behavior(tiny_batch(seed=7, groups=3, group_size=3), tiny_model(seed=5), seed=8)
    batch = broadcast_batch(batch if ranks.is_main else None, ranks)
    cfg = tiny_config(f"loss.weighting={weighting}", *COMMON, *extra)
    use_fp32_gemm(model, cfg.learner.fp32_gemm)  # before sharding, as the learner does
    if cfg.learner.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if ranks.world > 1:
        shard_model(model)
    optimizer = RecordingSGD(model.parameters(), lr=0.05)
    result = train_on_batch(
        model, optimizer, LossScaler(enabled=False), batch, cfg, AcrlReference(cfg.loss.acrl), ranks
    )
    state = {k: v.clone() for k, v in full_state_dict(model, ranks).items()}
    assert any(type(m) is OnednnLinear for m in model.modules()) == ("learner.fp32_gemm=onednn" in extra)
    assert is_checkpointed(model) == cfg.learner.gradient_checkpointing
    return {"grads": optimizer.applied, "metrics": result.metrics, "prox": result.prox_logp, "state": state}


def stepped_adamw(ranks: Dist) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model and an AdamW with one step of state (sharded with FSDP2 when ranks.world > 1)."""
    model = tiny_model(seed=5)
    if ranks.world > 1:
        shard_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    batch = tiny_batch(seed=7, groups=3, group_size=3)
    model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


def resume_single_process_state(ranks: Dist) -> tuple[dict, dict]:
    """Load a single-process learner's optimizer checkpoint into these ranks; (the checkpoint, gathered back)."""
    model, optimizer = stepped_adamw(SINGLE)
    saved = full_optimizer_state(model, optimizer, SINGLE)
    model = tiny_model(seed=5)
    if ranks.world > 1:
        shard_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    load_optimizer_state(model, optimizer, saved, ranks)
    return saved, full_optimizer_state(model, optimizer, ranks)


def _rank_main(rank: int, world: int, address: str, out_path: str) -> None:
    from learner.distributed import close, init_distributed

    torch.set_num_threads(1)
    ranks = init_distributed(rank, world, address)
    outputs = {f"{w}{extra}": run_case(w, extra, ranks) for w, extra in CASES}
    outputs["resumed_optimizer"] = resume_single_process_state(ranks)
    outputs["listening"] = [c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == "LISTEN"]
    if ranks.is_main:
        torch.save(outputs, out_path)
    close(ranks)


def test_fsdp2_world_2_gives_the_gradients_of_one_process(tmp_path):
    out_path = str(tmp_path / "rank0.pt")
    # A fork server that imports torch, transformers and this module once, then forks both ranks: half the start-up.
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    address = local_rendezvous(str(tmp_path))  # ranks on one machine, as `asyncrl up` runs them on a local cluster
    mp.start_processes(_rank_main, args=(2, address, out_path), nprocs=2, join=True, start_method="forkserver")
    sharded = torch.load(out_path, weights_only=False)
    assert sharded["listening"] and all(ip == "127.0.0.1" for ip in sharded["listening"]), sharded["listening"]
    for weighting, extra in CASES:
        single, dist = run_case(weighting, extra, SINGLE), sharded[f"{weighting}{extra}"]
        minibatches = 1 if "learner.minibatches=1" in extra else 2
        assert len(single["grads"]) == len(dist["grads"]) == minibatches, weighting  # none skipped
        for step_single, step_dist in zip(single["grads"], dist["grads"]):
            for g_single, g_dist in zip(step_single, step_dist):
                torch.testing.assert_close(g_dist, g_single, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dist["prox"], single["prox"], rtol=1e-5, atol=1e-5)
        for key in ("loss", "grad_norm", "norm_update"):
            assert abs(dist["metrics"][key] - single["metrics"][key]) <= 1e-5 * max(1.0, abs(single["metrics"][key]))
        assert dist["state"].keys() == single["state"].keys()
        for name, value in single["state"].items():
            torch.testing.assert_close(dist["state"][name], value, rtol=1e-5, atol=1e-5)
    # a checkpoint of a single-process learner resumes on 2 ranks with its optimizer state intact
    expected, resumed = sharded["resumed_optimizer"]
    assert resumed["state"].keys() == expected["state"].keys() and expected["state"]
    for name, moments in expected["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(resumed["state"][name][key], value, rtol=0, atol=0)


def _all_reduce_main(rank: int, world: int, address: str, out_dir: str) -> None:
    from learner.distributed import close, init_distributed

    ranks = init_distributed(rank, world, address)
    value = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(value)
    torch.save(value, f"{out_dir}/rank{rank}.pt")
    close(ranks)


def test_ranks_meet_at_a_tcp_rendezvous_too(tmp_path):
    """The rendezvous of ranks spread over a cluster (`ray.address`): a TCP store hosted by the learner group."""
    store, address = start_rendezvous()
    mp.start_processes(_all_reduce_main, args=(2, address, str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    del store
    assert [float(torch.load(tmp_path / f"rank{r}.pt")) for r in range(2)] == [3.0, 3.0]
