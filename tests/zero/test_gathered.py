"""Parameters read and changed outside `forward` under ZeRO, where a rank holds a share of each group: inside
`model.gathered_parameters()` every rank reads every parameter's whole value, and a change made there (an EMA
swap, a weight average) is kept as `load_state_dict` keeps it. A deep copy (an EMA model) is the whole model."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import chunkmem
from tests.helpers import gpt2_loss, mlp, mlp_loss, param_bytes, tiny_gpt2, train
from tests.multiproc import run_workers
from tests.zero.test_shards import global_batches, shard

ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.01)


def _values(named: object) -> dict[str, torch.Tensor]:
    return {name: p.detach().to("cpu", copy=True) for name, p in named}  # type: ignore[attr-defined]


def _halve(cm: torch.nn.Module, how: str) -> None:
    if how == "gathered":
        with cm.gathered_parameters(), torch.no_grad():
            for param in cm.parameters():
                param.mul_(0.5)
    else:
        cm.load_state_dict({k: v * 0.5 for k, v in cm.state_dict().items()})


def halving_worker(rank: int, world: int, how: str, fraction: float, folder: str) -> dict:
    model = tiny_gpt2()
    config = chunkmem.Config(device="cpu", dtype="fp32", device_memory=int(param_bytes(model) * fraction))
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), config)
    batches = [shard(b, rank, 2) for b in global_batches("gpt2", 4)]
    train(cm, opt, batches[:2], gpt2_loss)
    out: dict = {"whole": cm.state_dict()}
    if how == "gathered":
        out["copied"] = copy.deepcopy(cm).state_dict()  # an EMA model's copy: the whole model on every rank
        cm.save_pretrained(folder, is_main_process=rank == 0)  # gathered on every rank, written by one
        out["outside"] = _values(cm.module.named_parameters())
        with cm.gathered_parameters():
            out["inside"] = _values(cm.module.named_parameters())
            with pytest.raises(RuntimeError, match="inside model.gathered_parameters"):
                gpt2_loss(cm, batches[2])
    _halve(cm, how)
    out["halved"] = cm.state_dict()
    train(cm, opt, batches[2:], gpt2_loss)
    out["after"] = cm.state_dict()
    return out


@pytest.mark.slow
def test_every_rank_reads_the_whole_model_in_gathered_parameters_a_deep_copy_and_save_pretrained(tmp_path):
    # Inside the block a change is kept as load_state_dict keeps it.
    from transformers import GPT2LMHeadModel

    fraction = 1.5  # of the parameter bytes: ZeRO's buffers take most, and chunks move
    gathered = run_workers(halving_worker, 2, "gathered", fraction, str(tmp_path))
    loaded = run_workers(halving_worker, 2, "loaded", fraction, str(tmp_path / "unused"))
    saved = GPT2LMHeadModel.from_pretrained(tmp_path).state_dict()
    assert all(torch.equal(saved[n], v) for n, v in gathered[0]["whole"].items())
    for got, twin in zip(gathered, loaded):
        outside = [n for n, v in got["outside"].items() if v.isnan().any()]
        assert outside, "outside the block a rank reads NaN for the groups other ranks own"
        for name, value in got["inside"].items():
            assert torch.equal(value, got["whole"][name]), name
        assert all(torch.equal(got["copied"][n], v) for n, v in got["whole"].items())
        for name, value in got["whole"].items():
            assert torch.equal(got["halved"][name], value * 0.5), name
            assert torch.equal(got["after"][name], twin["after"][name]), name  # trained on alike


def test_without_zero_gathered_parameters_changes_nothing_and_keeps_changes():
    model = mlp(depth=4)
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()),
                               chunkmem.Config(device="cpu", dtype="fp32", device_memory=param_bytes(model) // 3))
    train(cm, opt, [(torch.randn(8, 32), torch.randn(8, 4)) for _ in range(2)], mlp_loss)
    before = cm.state_dict()
    with cm.gathered_parameters(), torch.no_grad():
        assert all(torch.equal(p.cpu(), before[n]) for n, p in cm.module.named_parameters())
        for param in cm.parameters():
            param.mul_(0.5)
    assert all(torch.equal(v, before[k] * 0.5) for k, v in cm.state_dict().items())


def bf16_worker(rank: int, world: int) -> dict:
    model = mlp(width=32, depth=5)
    model[2].requires_grad_(False)
    cm, opt = chunkmem.prepare(model, ADAMW(model.parameters()), chunkmem.Config(device="cpu", dtype="bf16"))
    batches = [shard(b, rank, world) for b in global_batches("mlp", 4)]
    train(cm, opt, batches[:2], mlp_loss)
    whole = cm.state_dict()
    with cm.gathered_parameters(), torch.no_grad():
        inside = _values(cm.module.named_parameters())
        cm.module[2].weight.mul_(0.5)  # frozen
        cm.module[0].weight.data = torch.zeros_like(cm.module[0].weight)
    kept = cm.state_dict()
    with pytest.raises(ValueError, match="4.weight was given shape"), cm.gathered_parameters(), torch.no_grad():
        cm.module[6].weight.mul_(2.0)
        cm.module[4].weight.data = torch.zeros(3, 3, dtype=torch.bfloat16)
    return {"whole": whole, "inside": inside, "kept": kept, "refused": cm.state_dict()}


@pytest.mark.slow
def test_gathered_parameters_in_bf16_keep_the_master_of_what_did_not_change_and_a_bad_change_keeps_nothing():
    for got in run_workers(bf16_worker, 2):
        whole, kept = got["whole"], got["kept"]
        for name, value in got["inside"].items():  # the compute dtype's values of the fp32 masters
            assert value.dtype == torch.bfloat16 and torch.equal(value, whole[name].bfloat16()), name
        assert torch.equal(kept["2.weight"], (whole["2.weight"].bfloat16() * 0.5).float())
        assert not kept["0.weight"].any()
        changed = {"0.weight", "2.weight"}
        assert all(torch.equal(kept[n], v) for n, v in whole.items() if n not in changed)  # masters not rounded
        assert all(torch.equal(got["refused"][n], v) for n, v in kept.items())
