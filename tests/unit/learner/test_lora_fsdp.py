"""LoRA under FSDP2 (`learner.world_size=2`, gloo, spawned ranks) = one learner process: the same log-probs on the
rollout-aligned INT8 base, the same published adapters (gathered on rank 0, int8 on the wire), the same update."""

from __future__ import annotations

import multiprocessing

import torch
import torch.multiprocessing as mp
from tiny_learner import tiny_batch, with_behavior

from common.builtin_model import resolve_model_path
from common.config import load_config, to_dict
from learner import lora
from learner.acrl import AcrlReference
from learner.distributed import SINGLE, Dist, local_rendezvous
from learner.precision import LossScaler
from learner.sections import LearnerSections
from learner.trainer import Learner
from learner.update import train_on_batch
from quant_sync.export import LORA_A, LORA_B
from quant_sync.transport import WeightSubscriber

OVERRIDES = ("model.path=builtin:micro", "model.lora.rank=4", "quant.scheme=int8", "model.lora.sync_dtype=int8",
             "learner.minibatches=1", "optim.grad_clip=0")  # fmt: skip
MICRO_VOCAB = 16
PROMPT, RESPONSE = [1, 4, 5, 13, 6, 7, 15], [5, 6, 7, 8, 9]


def _model_dir() -> str:
    return str(resolve_model_path("builtin:micro", log=lambda *_: None))


@torch.no_grad()
def _perturb_adapters(model: torch.nn.Module) -> None:
    """The same nonzero adapters on any world size: full noise, each rank adding its own shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    for name, param in model.named_parameters():
        if "lora_" in name:
            noise = 0.05 * torch.randn(param.shape, generator=gen)
            param.add_(distribute_tensor(noise, param.device_mesh, param.placements) if isinstance(param, DTensor)
                       else noise)  # fmt: skip


def run(ranks: Dist, address: str = "") -> dict[str, object]:
    """Build a LoRA learner on `ranks`, perturb its adapters, take log-probs, publish version 1 (rank 0 fetches it
    back through a subscriber) and one SGD update; returns what rank 0 saw."""
    cfg = load_config(None, [*OVERRIDES, f"learner.world_size={ranks.world}"])
    sections = LearnerSections.pick(cfg)
    learner = Learner(to_dict(sections), _model_dir(), "tcp://127.0.0.1:9", rank=ranks.rank, rendezvous=address)
    try:
        model = learner.model
        _perturb_adapters(model)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([PROMPT + RESPONSE])).logits[0].float().log_softmax(-1)
        logp = logits[len(PROMPT) - 1 : -1].gather(1, torch.tensor(RESPONSE)[:, None]).squeeze(1)
        metrics = learner._publish(1)  # a collective: the adapters gathered on rank 0
        copy = learner._full_precision_copy()  # rank 0: an unsharded peft model (evaluation); a collective
        copy_logp = None
        if copy is not None:
            with torch.no_grad():
                out = copy(input_ids=torch.tensor([PROMPT + RESPONSE])).logits[0].float().log_softmax(-1)
            copy_logp = out[len(PROMPT) - 1 : -1].gather(1, torch.tensor(RESPONSE)[:, None]).squeeze(1)
        published = {}
        if ranks.is_main:
            received = []
            subscriber = WeightSubscriber(learner.weights_endpoint(), received.append, 0.01)
            try:
                assert subscriber.wait_for(1, 30) and subscriber.rejected == 0, subscriber.last_error
            finally:
                subscriber.close()
            published = {k: v for k, v in received[-1].tensors.items() if k.endswith((LORA_A, LORA_B))}
        behavior = _hf_model(_model_dir())
        batch = tiny_batch(seed=7, groups=2, group_size=3)
        batch.input_ids, batch.response_ids = batch.input_ids % MICRO_VOCAB, batch.response_ids % MICRO_VOCAB
        batch = with_behavior(batch, behavior, seed=8)
        before = {name: value.clone() for name, value in lora.gather_adapters(model).items()}
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=0.5)
        result = train_on_batch(model, optimizer, LossScaler(enabled=False), batch, sections, AcrlReference(
            sections.loss.acrl), learner.ranks)  # fmt: skip
        after = {name: value.clone() for name, value in lora.gather_adapters(model).items()}
        trainable_names = sorted(name for name, p in model.named_parameters() if p.requires_grad)
        return {"logp": logp, "copy_logp": copy_logp, "metrics": metrics, "published": published, "before": before,
                "after": after, "skipped": result.skipped, "loss": result.metrics["loss"],
                "trainable": trainable_names}  # fmt: skip
    finally:
        learner.close()


def _hf_model(model_dir: str) -> torch.nn.Module:
    """The plain Hugging Face model (behavior log-probs)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def _rank_main(rank: int, world: int, address: str, out_path: str) -> None:
    from learner.distributed import Dist

    torch.set_num_threads(1)
    outputs = run(Dist(rank=rank, world=world), address)
    if rank == 0:
        torch.save(outputs, out_path)


def test_lora_under_fsdp2_matches_one_process(tmp_path):
    _model_dir()  # build the built-in model once, before the ranks start
    out_path = str(tmp_path / "rank0.pt")
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    address = local_rendezvous(str(tmp_path))
    mp.start_processes(_rank_main, args=(2, address, out_path), nprocs=2, join=True, start_method="forkserver")
    sharded = torch.load(out_path, weights_only=False)
    single = run(SINGLE)
    assert sharded["trainable"] == single["trainable"] and all("lora_" in n for n in single["trainable"])
    torch.testing.assert_close(sharded["logp"], single["logp"], rtol=0, atol=1e-5)
    torch.testing.assert_close(sharded["copy_logp"], single["logp"], rtol=0, atol=1e-5)  # the gathered copy too
    assert single["published"] and sharded["published"].keys() == single["published"].keys()
    for name, value in single["published"].items():  # int8 on the wire, decoded: the very same values
        torch.testing.assert_close(sharded["published"][name], value, rtol=0, atol=0)
    for key in ("sync/bytes_per_version", "lora/norm_B"):
        assert abs(sharded["metrics"][key] - single["metrics"][key]) <= 1e-6 * max(1.0, single["metrics"][key])
    assert not sharded["skipped"] and not single["skipped"]
    assert abs(sharded["loss"] - single["loss"]) <= 1e-5 * max(1.0, abs(single["loss"]))
    assert sharded["after"].keys() == single["after"].keys()
    for name, value in single["after"].items():  # one SGD step: the same gradients on 2 ranks as on one
        torch.testing.assert_close(sharded["before"][name], single["before"][name], rtol=0, atol=0)
        torch.testing.assert_close(sharded["after"][name], value, rtol=1e-5, atol=1e-6)
    assert all(not torch.equal(single["after"][n], single["before"][n]) for n in single["after"])  # every one moved
