"""Several models under one chunkmem.Manager: one budget, one plan, results as plain PyTorch's."""

from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

import chunkmem
import torch.distributed as dist
from benchmarks.optimum import solve
from benchmarks.placement_problem import Instance
from benchmarks.record import recording
from benchmarks.several_models import load_dpo
from chunkmem.chunks.placement import Phase
from tests.helpers import module_hooks, updates
from tests.multiproc import run_workers

DPO = load_dpo()
CHUNK = 16384  # the embedding's elements
PROMPT = 8


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    policy = DPO.tiny_llama(0, layers=2, width=64)
    return policy, copy.deepcopy(policy)


def reward_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return LlamaForSequenceClassification(LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, num_labels=1, pad_token_id=0))


def pairs(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return DPO.preference_pairs(steps, 2, PROMPT, 16)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def with_adamw(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    return model, adamw(model)


def managed(budget: int | None, *frozen: torch.nn.Module) -> tuple[chunkmem.Manager, list]:
    """A manager holding a fresh policy (with AdamW), its reference, and `frozen` models besides."""
    policy, reference = models()
    manager = chunkmem.Manager(chunkmem.Config(device="cpu", dtype="fp32", chunk_size=CHUNK, device_memory=budget))
    prepared = [*manager.prepare(policy, adamw(policy)), manager.prepare(reference)]
    return manager, prepared + [manager.prepare(m) for m in frozen]


def step(policy, optimizer, reference, pair, reward=None) -> float:
    loss = DPO.dpo_loss(policy, reference, *pair, PROMPT)
    if reward is not None:  # a reward-weighted term, as a policy-gradient step would add
        with torch.no_grad():
            score = reward(pair[0]).logits.squeeze(-1)
        loss = loss - 0.1 * (score * DPO.sequence_logps(policy, pair[0], PROMPT)).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def plain_losses(batches, reward=None) -> tuple[list[float], dict[str, torch.Tensor]]:
    policy, reference = models()
    optimizer = adamw(policy)
    return [step(policy, optimizer, reference, pair, reward) for pair in batches], policy.state_dict()


def small_budget(*frozen: torch.nn.Module, share: float = 0.4) -> tuple[int, int]:
    """The budget of the activation peak plus `share` of every model's data, and that data, from a probe."""
    manager, (policy, optimizer, reference, *others) = managed(None, *copy.deepcopy(list(frozen)))
    step(policy, optimizer, reference, pairs(1)[0], *others)
    stats = manager.memory_stats()
    return manager.runtime.activations.peak + int(share * stats["model_data_bytes"]), stats["model_data_bytes"]


def test_dpo_under_one_budget_below_both_models_data_is_bit_identical_to_plain():
    batches = pairs(5)
    budget, data = small_budget()
    manager, (policy, optimizer, reference) = managed(budget)
    losses = [step(policy, optimizer, reference, pair) for pair in batches]
    expected, state = plain_losses(batches)
    assert losses == expected
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in state.items())
    stats = manager.memory_stats()
    assert budget < data and stats["device_bytes_peak"] <= budget
    assert stats["h2d_bytes"] > 0 and manager.runtime.placer.phase is Phase.FOLLOW


@pytest.mark.slow
@pytest.mark.parametrize("share", [0.5, 0.25])
def test_the_shared_plan_moves_what_the_exact_optimum_moves(share):
    # The optimum is benchmarks/optimum.py's integer program over the recorded step of both models (homes chosen
    # too). An early upload of the policy's parameters once squeezed the reference's forward: 1.43x it at 50%.
    batches = pairs(6)
    budget, _ = small_budget(share=share)
    with recording() as seen:
        manager, (policy, optimizer, reference) = managed(budget)
        moved = []
        for pair in batches:
            before = manager.memory_stats()
            step(policy, optimizer, reference, pair)
            after = manager.memory_stats()
            moved.append(after["h2d_bytes"] + after["d2h_bytes"] - before["h2d_bytes"] - before["d2h_bytes"])
    events, groups, sizes, limit = seen[0]
    store = manager.runtime.store
    streamed = {g.index: sum(r.param.numel() for r in g.members) * 4 for g in store.trainable_groups()}
    best = solve(Instance.from_events(events, sizes, groups, limit, streamed=streamed), time_limit=60)
    assert len(seen) == 1 and best.optimal
    assert moved[-3:] == [best.bytes] * 3, (moved, best.bytes)


def test_a_model_whose_forward_ran_resident_gets_its_hooks_back_once_another_takes_the_full_path():
    # A step may run one model's forward resident (its module hooks off: runtime's Note on resident steps), then
    # another's on the full path (inputs of a new shape): the first may recompute a checkpointed module in backward
    # after chunks moved, and needs its hooks for that.
    manager, (policy, optimizer, reference) = managed(None)
    data = pairs(4)
    for pair in data[:3]:
        step(policy, optimizer, reference, pair)
    logits = policy(data[3][0]).logits
    assert manager.runtime.placer.resident and module_hooks(policy) == module_hooks(reference) == 0
    reference(data[3][0][:, :12])  # gradients on: a training forward, of a new shape
    assert not manager.runtime.placer.resident
    assert module_hooks(policy) == module_hooks(reference) == 2 * len(list(policy.module.modules()))
    logits.sum().backward()


def test_a_frozen_model_gets_parameter_chunks_only_and_its_forwards_join_the_plan():
    manager, (policy, _, reference) = managed(None)
    runtime = manager.runtime
    assert policy.runtime is reference.runtime is runtime
    frozen = {runtime.store.records[p].group for p in reference.module.parameters()}
    trained = {runtime.store.records[p].group for p in policy.module.parameters()}
    assert not frozen & trained and not any(g.trainable for g in frozen)
    assert all(set(g.chunks) <= {"param"} for g in frozen)
    assert all({"param", "grad", "exp_avg", "exp_avg_sq"} <= set(g.chunks) for g in trained)
    assert not any(p.requires_grad for p in reference.module.parameters())
    assert reference.hooks.scores_in_step and not policy.hooks.scores_in_step
    # Its records carry its own names (checkpoints and state dicts use them), not the set's "1." ones.
    assert {r.name for r in reference.own_records} == {n for n, _ in reference.module.named_parameters()}


def test_three_models_under_one_manager_match_plain():
    batches = pairs(4)
    budget, data = small_budget(reward_model())
    manager, (policy, optimizer, reference, reward) = managed(budget, reward_model())
    losses = [step(policy, optimizer, reference, pair, reward) for pair in batches]
    expected, state = plain_losses(batches, reward_model())
    assert losses == expected
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in state.items())
    assert reward.runtime is policy.runtime and manager.memory_stats()["device_bytes_peak"] <= budget < data


def test_a_checkpoint_of_the_trained_model_resumes_exactly(tmp_path):
    batches = pairs(4)
    budget, _ = small_budget()
    manager, (policy, optimizer, reference) = managed(budget)
    for pair in batches[:2]:
        step(policy, optimizer, reference, pair)
    chunkmem.save_checkpoint(tmp_path / "ckpt", policy, optimizer)
    expected = [step(policy, optimizer, reference, pair) for pair in batches[2:]]
    manager, (policy, optimizer, reference) = managed(budget)
    # The reference paired with the policy's optimizer (one runtime holds both) was saved, and loaded over the frozen
    # reference, with the policy's optimizer states.
    before = reference.state_dict()
    with pytest.raises(ValueError, match="prepared with another model"):
        chunkmem.save_checkpoint(tmp_path / "wrong", reference, optimizer)
    with pytest.raises(ValueError, match="prepared with another model"):
        chunkmem.load_checkpoint(tmp_path / "ckpt", reference, optimizer)
    assert not (tmp_path / "wrong").exists()
    assert all(torch.equal(v, reference.state_dict()[k]) for k, v in before.items())
    chunkmem.load_checkpoint(tmp_path / "ckpt", policy, optimizer)
    assert [step(policy, optimizer, reference, pair) for pair in batches[2:]] == expected


@pytest.mark.parametrize("budget", [None, "small"])
def test_a_checkpoint_loaded_between_two_prepares_resumes_exactly(tmp_path, budget):
    # The reference's prepare lays the policy out again: its step counts and optimizer states come along.
    batches = pairs(4)
    budget = small_budget()[0] if budget else None
    manager, (policy, optimizer, reference) = managed(budget)
    for pair in batches[:2]:
        step(policy, optimizer, reference, pair)
    chunkmem.save_checkpoint(tmp_path / "ckpt", policy, optimizer)
    expected = [step(policy, optimizer, reference, pair) for pair in batches[2:]], policy.state_dict()
    policy, reference = models()
    manager = chunkmem.Manager(chunkmem.Config(device="cpu", dtype="fp32", chunk_size=CHUNK, device_memory=budget))
    policy, optimizer = manager.prepare(policy, adamw(policy))
    chunkmem.load_checkpoint(tmp_path / "ckpt", policy, optimizer)
    reference = manager.prepare(reference)
    losses = [step(policy, optimizer, reference, pair) for pair in batches[2:]]
    assert losses == expected[0]
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in expected[1].items())


def test_parameters_given_other_storage_between_two_prepares_keep_it():
    policy, reference = models()
    manager = chunkmem.Manager(chunkmem.Config(device="cpu", dtype="fp32", chunk_size=CHUNK))
    policy, optimizer = manager.prepare(policy, adamw(policy))
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(torch.zeros(sum(p.numel() for p in policy.parameters())),
                                            policy.parameters())  # p.data = ... for each
    manager.prepare(reference)
    assert all(not v.any() for v in policy.state_dict().values())


def test_a_budget_too_small_for_the_largest_working_set_is_refused_at_the_last_prepare_changing_nothing(monkeypatch):
    policy, _ = models()
    manager = chunkmem.Manager(chunkmem.Config(device="cpu", dtype="fp32", chunk_size=CHUNK,
                                               device_memory=3 * CHUNK * 4))
    policy, optimizer = manager.prepare(policy, adamw(policy))
    wide = torch.nn.Module()  # one module pinning 4 chunks at once
    for name in "abcd":
        wide.register_parameter(name, torch.nn.Parameter(torch.randn(CHUNK)))
    before = {n: p.detach().clone() for n, p in wide.named_parameters()}
    with pytest.raises(chunkmem.MemoryBudgetError, match=str(4 * CHUNK * 4)):
        manager.prepare(wide)
    assert all(torch.equal(p, before[n]) and p.requires_grad for n, p in wide.named_parameters())
    assert manager.models == [policy] and policy.runtime is manager.runtime
    with monkeypatch.context() as patch:  # a device where no parameter is: the model says its runtime's
        patch.setattr(manager.runtime.device, "torch_device", torch.device("meta"))
        assert policy.module.device == torch.device("meta")
    ids = pairs(1)[0][0]
    plain, _ = models()
    assert policy(ids).logits.equal(plain(ids).logits)  # the earlier model is as it was


def test_each_model_says_it_is_where_the_runtime_it_moved_to_computes(monkeypatch):
    manager, (policy, _, reference) = managed(None)  # the policy moved to the runtime the reference's prepare made
    monkeypatch.setattr(manager.runtime.device, "torch_device", torch.device("meta"))  # where no parameter is
    assert policy.device == policy.module.device == reference.module.device == torch.device("meta")


def test_generation_between_steps_gives_plain_tokens_and_keeps_the_plan():
    batches = pairs(4)
    budget, _ = small_budget()
    manager, (policy, optimizer, reference) = managed(budget)
    plain, plain_reference = models()
    plain_optimizer = adamw(plain)
    prompt = batches[0][0][:, :PROMPT]
    with recording() as planned:
        for pair in batches:
            assert step(policy, optimizer, reference, pair) == step(plain, plain_optimizer, plain_reference, pair)
            ours = policy.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(ours, plain.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0))
            assert manager.runtime.placer.phase is Phase.FOLLOW
    assert len(planned) == 1, "generation made the plan record again"


def actor_critic_step(actor, actor_optimizer, critic, critic_optimizer, reference, pair) -> tuple[float, float]:
    """A PPO-shaped step: the actor's DPO loss weighted by the critic's value, the critic regressed on a target;
    two backwards, then each optimizer steps."""
    value = critic(pair[0]).logits.squeeze(-1)
    actor_loss = DPO.dpo_loss(actor, reference, *pair, PROMPT) * (1 + value.detach().mean())
    critic_loss = (value - 1.0).pow(2).mean()
    actor_loss.backward()
    critic_loss.backward()
    actor_optimizer.step()
    critic_optimizer.step()
    actor_optimizer.zero_grad()
    critic_optimizer.zero_grad()
    return actor_loss.item(), critic_loss.item()


def test_two_trained_models_under_one_budget_match_plain_and_one_plan_covers_both_updates():
    batches = pairs(6)
    actor, reference = models()
    critic = reward_model()
    config = chunkmem.Config(device="cpu", dtype="fp32", chunk_size=CHUNK)
    probe = chunkmem.Manager(config)
    for model in (actor, critic):
        probe.prepare(*with_adamw(copy.deepcopy(model)))
    data = probe.memory_stats()["model_data_bytes"]
    budget = 3 * data // 5  # about the 6 MB at which two trained models once read NaNs
    manager = chunkmem.Manager(dataclasses.replace(config, device_memory=budget))
    ours = [*manager.prepare(*with_adamw(copy.deepcopy(actor))), *manager.prepare(*with_adamw(copy.deepcopy(critic)))]
    ours_reference = manager.prepare(copy.deepcopy(reference))
    with recording() as planned:
        losses = [actor_critic_step(*ours, ours_reference, pair) for pair in batches]
    plain = [actor, adamw(actor), critic, adamw(critic)]
    assert losses == [actor_critic_step(*plain, reference, pair) for pair in batches]
    for model, reference_model in ((ours[0], actor), (ours[2], critic)):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in reference_model.state_dict().items())
    stats = manager.memory_stats()
    assert stats["h2d_bytes"] > 0 and stats["device_bytes_peak"] <= budget < data
    runtime = manager.runtime
    assert runtime.step_count == len(batches), "a step ends once both optimizers stepped"
    assert len(planned) == 1 and runtime.placer.phase is Phase.FOLLOW and runtime.placer.replans == 0


def critic_first_step(actor, actor_optimizer, critic, critic_optimizer, pair) -> tuple[float, ...]:
    """The critic's backward, then the actor's forward, then the critic's gradients clipped and stepped: what the
    actor's forward left of them in `p.grad`."""
    critic_loss = (critic(pair[0]).logits.squeeze(-1) - 1.0).pow(2).mean()
    critic_loss.backward()
    actor_loss = DPO.sequence_logps(actor, pair[0], PROMPT).mean()
    shown = sum(p.grad is not None for p in critic.parameters())
    norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), 0.05).item()
    critic_optimizer.step()
    critic_optimizer.zero_grad()
    actor_loss.backward()
    actor_optimizer.step()
    actor_optimizer.zero_grad()
    return critic_loss.item(), actor_loss.item(), shown, norm


@pytest.mark.parametrize("share", [None, 0.6])
def test_one_models_forward_leaves_another_models_gradients_shown_for_its_clipping(share):
    # The actor's forward hid the critic's gradients: clipping them read None and clipped nothing (helper-71).
    batches = pairs(3)
    actor, critic = DPO.tiny_llama(0, layers=2, width=64), reward_model()
    config = chunkmem.Config(device="cpu", dtype="fp32", chunk_size=CHUNK)
    budget = None
    if share is not None:  # of both models' data
        probe = chunkmem.Manager(config)
        for model in (actor, critic):
            probe.prepare(*with_adamw(copy.deepcopy(model)))
        budget = int(share * probe.memory_stats()["model_data_bytes"])
    manager = chunkmem.Manager(dataclasses.replace(config, device_memory=budget))
    ours = [*manager.prepare(*with_adamw(copy.deepcopy(actor))), *manager.prepare(*with_adamw(copy.deepcopy(critic)))]
    results = [critic_first_step(*ours, pair) for pair in batches]
    plain = [actor, adamw(actor), critic, adamw(critic)]
    assert results == [critic_first_step(*plain, pair) for pair in batches]
    assert all(shown == len(list(critic.parameters())) for _, _, shown, _ in results)
    for model, reference_model in ((ours[0], actor), (ours[2], critic)):
        assert all(torch.equal(model.state_dict()[k], v) for k, v in reference_model.state_dict().items())
    assert (manager.memory_stats()["evictions"] > 0) == (budget is not None)


def test_a_models_forward_without_backward_leaves_every_models_gradients_shown_and_warns_of_none(caplog):
    # The warning that `p.grad` read None before a step went to the first optimizer to step, another model's whose
    # gradients showed all along (helper-72). The actor's own were hidden by that forward then; where gradients are on
    # the device with their parameters they stay shown until a backward begins now (grads.py's `kept_through_forward`),
    # as in PyTorch, and no step warns.
    manager = chunkmem.Manager(chunkmem.Config(device="cpu", dtype="fp32", chunk_size=CHUNK))
    actor, actor_optimizer = manager.prepare(*with_adamw(DPO.tiny_llama(0, layers=2, width=64)))
    critic, critic_optimizer = manager.prepare(*with_adamw(reward_model()))
    pair = pairs(1)[0]
    DPO.sequence_logps(actor, pair[0], PROMPT).mean().backward()
    (critic(pair[0]).logits.squeeze(-1) - 1.0).pow(2).mean().backward()
    DPO.sequence_logps(actor, pair[1], PROMPT).mean()  # a metric with gradients enabled, and no backward
    warned = []
    for model, optimizer in ((critic, critic_optimizer), (actor, actor_optimizer)):
        shown = all(p.grad is not None for p in model.parameters())
        caplog.clear()
        optimizer.step()
        warned.append((shown, "p.grad was None until this step" in caplog.text))
    assert warned == [(True, False), (True, False)]


def test_prepare_refuses_another_optimizer_kind_models_sharing_parameters_and_any_model_after_a_forward():
    manager, (policy, _, reference) = managed(None)
    critic = reward_model()
    with pytest.raises(ValueError, match=r"this optimizer keeps no states, the one this manager trains with keeps "
                                         r"\['exp_avg', 'exp_avg_sq'\]"):
        manager.prepare(critic, torch.optim.SGD(critic.parameters(), lr=0.1))
    assert manager.models == [policy, reference] and critic.model.layers[0].mlp.up_proj.weight.requires_grad
    fp16 = chunkmem.Manager(chunkmem.Config(device="cpu", dtype="fp16"))
    fp16.prepare(*with_adamw(reward_model()))
    with pytest.raises(NotImplementedError, match="one loss scaler"):
        fp16.prepare(critic, adamw(critic))
    twin = torch.nn.Linear(64, 256, bias=False)
    twin.weight = reference.module.lm_head.weight  # frozen: no hook of ours on it
    with pytest.raises(ValueError, match="belongs to a model this manager prepared"):
        manager.prepare(twin)
    reference(pairs(1)[0][0])
    with pytest.raises(RuntimeError, match="before the first forward"):
        manager.prepare(reward_model())


def test_an_optimizer_holding_another_managed_models_parameter_is_refused_changing_nothing():
    manager, (policy, optimizer, reference) = managed(None)
    critic = reward_model()
    taken = policy.module.lm_head.weight
    with pytest.raises(ValueError, match="parameter lm_head.weight of another model"):
        manager.prepare(critic, torch.optim.AdamW([*critic.parameters(), taken], lr=1e-3))
    assert manager.models == [policy, reference] and critic.model.layers[0].mlp.up_proj.weight.requires_grad
    gc.collect()  # the runtime the refused prepare made, gone: the earlier models' `p.data` is still chunkmem's
    torch.autograd.graph.increment_version(taken)
    assert taken.data._version == taken._version > 0, "outside a forward it shares the version (store.py's Note)"
    torch.autograd.graph.increment_version(critic.score.weight)
    assert critic.score.weight.data._version == 0  # PyTorch's: the refused model's parameters are not managed
    name, first = next(policy.module.named_parameters())
    halved = first.detach().clone() * 0.5
    with torch.no_grad():  # its host payload, which an upload of the first prepare read: the host must know it landed
        first.mul_(0.5)
    assert torch.equal(policy.state_dict()[name], halved)
    critic, critic_optimizer = manager.prepare(critic, adamw(critic))
    groups = [len(o.param_groups) for o in (optimizer, critic_optimizer)]
    with pytest.raises(ValueError, match="another model this chunkmem.Manager prepared"):
        optimizer.add_param_group({"params": [critic.module.score.weight]})
    with pytest.raises(ValueError, match="another model"):
        critic_optimizer.add_param_group({"params": taken})
    assert [len(o.param_groups) for o in (optimizer, critic_optimizer)] == groups
    optimizer.param_groups[0]["params"].append(critic.module.score.weight)  # edited by hand: found at the step
    with pytest.raises(ValueError, match="score.weight of another model"):
        step(policy, optimizer, reference, pairs(1)[0])


def test_a_step_refused_for_another_models_parameter_leaves_the_loss_scale_as_it_was():
    policy, reference = models()
    manager = chunkmem.Manager(chunkmem.Config(device="cpu", dtype="fp16", chunk_size=CHUNK))
    policy, optimizer = manager.prepare(policy, adamw(policy))
    reference = manager.prepare(reference)
    DPO.dpo_loss(policy, reference, *pairs(1)[0], PROMPT).backward()
    scaler = dataclasses.replace(manager.runtime.scaler)
    optimizer.param_groups[0]["params"].append(reference.module.lm_head.weight)
    with pytest.raises(ValueError, match="lm_head.weight of another model"):
        optimizer.step()  # it counted a good step first
    assert manager.runtime.scaler == scaler


def sharded_dpo(rank: int, world: int, budget: int) -> dict:
    policy, reference = models()
    initial = {k: v.clone() for k, v in policy.state_dict().items()}
    manager = chunkmem.Manager(chunkmem.Config(device="cpu", dtype="fp32", chunk_size=CHUNK,
                                               device_memory=budget))
    policy, optimizer = manager.prepare(policy, adamw(policy))
    reference = manager.prepare(reference)
    losses = []
    for pair in pairs(4):
        loss = torch.tensor(step(policy, optimizer, reference, tuple(t.chunk(world)[rank] for t in pair)),
                            dtype=torch.float64)
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return {"losses": losses, "updates": updates(initial, policy.state_dict()), "stats": manager.memory_stats(),
            "sharded": manager.runtime.shards is not None}


def test_a_manager_shards_its_models_over_ranks_and_trains_as_one_process_on_the_whole_batch():
    policy, reference = models()
    initial = {k: v.clone() for k, v in policy.state_dict().items()}
    optimizer = adamw(policy)
    expected = [step(policy, optimizer, reference, pair) for pair in pairs(4)]
    reference_updates = updates(initial, policy.state_dict())
    budget, whole = small_budget(share=0.25)  # a quarter of both models' data: about half of a rank's share
    for got in run_workers(sharded_dpo, 2, budget, timeout=300):
        assert got["sharded"] and got["losses"] == pytest.approx(expected, rel=1e-5)
        for name, update in reference_updates.items():  # the gradients are reduced over ranks: rounding differs
            assert (got["updates"][name] - update).norm() <= 2e-3 * update.norm(), name
        stats = got["stats"]
        assert stats["model_data_bytes"] < whole / 2 + 2 * CHUNK * 4 * 4  # each rank keeps half, give or take a group
        assert stats["device_bytes_peak"] <= budget and stats["transient_bytes_peak"] <= stats["transient_reserved_bytes"]
        assert stats["device_chunk_bytes_peak"] < stats["model_data_bytes"] < stats["h2d_bytes"]  # chunks moved
