"""`chunkmem.pipeline`: an nn.Sequential trained as chunk-managed stages, one (or a few) per rank.

Each rank builds the whole (CPU or meta-free) model, keeps its stages' layers, and prepares them with
chunkmem under its own Config (its own device budget). torch.distributed.pipelining's PipelineStage
and schedules (GPipe, 1F1B, interleaved 1F1B, zero bubble) move activations and gradients between
ranks; PipeDream-2BW runs on chunkmem's own executor (flow.py). With data_parallel=D, world = D x K
ranks form D pipelines; position s of every pipeline shards its model data over their data-parallel
group (chunkmem's ZeRO), which also averages their gradients.

[Note: what stays exact]
Every micro-batch's loss is weighted so that the sum of micro-batch gradients (and the average
across pipelines ZeRO takes) equals the gradient of the loss on the whole mini-batch: a mean-reduced
loss weighs micro-batch i by D * n_i / B, a sum-reduced one by D. torch's own `scale_grads`
(divide by M) is off: it is only right when all micro-batches have the same size, and chunkmem's
gradients live in chunks, not in `p.grad`, where it would look for them.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from chunkmem.checkpoint import (all_read, all_written, attempt, check_replaceable, existing, load_checkpoint,
                                 save_checkpoint, swap_in)
from chunkmem.chunks.state import TensorState
from chunkmem.config import Config
from chunkmem.errors import CheckpointError
from chunkmem.files import fsync_dir, fsync_file
from chunkmem.memory.device import use_device
from chunkmem.pipeline import balance as balancing
from chunkmem.pipeline.flow import Feed, Flow
from chunkmem.pipeline.layout import make_layout, stage_ranks
from chunkmem.pipeline.schedule import SCHEDULES, Action, in_flight
from chunkmem.pipeline.stage import CHECKPOINT_MODES, Microbatches, Part, StageBody, layers_of
from chunkmem.pipeline.versions import STALE, WeightVersions
from chunkmem.runtime.optim import ChunkOptimizer
from chunkmem.wrapper import ChunkedModel, prepare

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]
VIRTUAL = ("interleaved", "zero-bubble", "zbv")  # schedules with several stages per rank


class Pipeline:
    """See `pipeline()`. After the first `step`, `model`/`optimizer` are this rank's prepared stages."""

    def __init__(self, model: nn.Module, optimizer_factory: OptimizerFactory, loss_fn: LossFn, *,
                 n_microbatches: int, schedule: str, balance: str | Sequence[int], checkpoint: str,
                 reduction: str, config: Config | Sequence[Config] | None, data_parallel: int,
                 virtual_stages: int | None = None) -> None:
        _check_arguments(schedule, checkpoint, reduction, n_microbatches, virtual_stages)
        first = config[0] if isinstance(config, (list, tuple)) and config else config
        self.layout = make_layout(data_parallel, first.device if isinstance(first, Config) else Config().device)
        self.virtual = (virtual_stages or 2) if schedule in VIRTUAL else 1
        k, m = self.layout.n_ranks, n_microbatches
        _scheduled().check_layout(schedule, k, m, self.virtual, data_parallel)
        self.stage_ranks = stage_ranks(k, self.virtual, "v" if schedule == "zbv" else "loop")
        self.stages = [i for i, r in enumerate(self.stage_ranks) if r == self.layout.position]
        self.configs = _rank_configs(config, k)
        self.device = use_device(self.configs[self.stage].device)
        # What collectives carry tensors on: NCCL only device memory, gloo host memory.
        self.comm_device = self.device if dist.get_backend(self.layout.pipe_group) == "nccl" else torch.device("cpu")
        self._layers: list[tuple[str, nn.Module]] | None = layers_of(model)
        self._keys = list(nn.Sequential(OrderedDict(self._layers)).state_dict().keys())
        self._check_balance(balance)
        self.optimizer_factory, self.loss_fn = optimizer_factory, loss_fn
        self.n_microbatches, self.schedule_name, self.checkpoint = n_microbatches, schedule, checkpoint
        self.reduction, self.balance_spec = reduction, balance
        self.balance: list[int] | None = None  # layer counts per stage, once built
        self.model: ChunkedModel | None = None
        self.optimizer: ChunkOptimizer | None = None
        self.parts: dict[int, Part] = {}  # this rank's stages, by index
        self.versions: WeightVersions | None = None  # 2BW's
        self._runners: dict[tuple, Any] = {}
        self._flow: Flow | None = None  # the 2BW flow that ran last
        self._carried = math.nan  # the loss its flush returned, for the next step to return
        self._loss_group: Any = None
        self._micro_loss: LossFn | None = None
        self.last_order: list[Action] = []  # what this rank ran in the last step
        self._pending_load: Path | None = None  # a checkpoint to restore once the stages are built

    @property
    def stage(self) -> int:
        """This rank's position in its pipeline (its stage, with one stage per rank)."""
        return self.layout.position

    @property
    def n_stages(self) -> int:
        return len(self.stage_ranks)

    @property
    def effective_schedule(self) -> str:
        """The schedule that runs: torch's 1F1B needs M >= K; with fewer micro-batches than stages,
        GPipe runs instead (it then holds no more activations than 1F1B could save)."""
        if self.schedule_name == "1f1b" and self.n_microbatches < self.n_stages:
            return "gpipe"
        return self.schedule_name

    def _check_balance(self, balance: str | Sequence[int]) -> None:
        n, k = len(self._layers or []), self.n_stages
        if balance == "auto":
            return
        if isinstance(balance, str) or not all(isinstance(c, int) and c >= 1 for c in balance) \
                or len(balance) != k or sum(balance) != n:
            raise ValueError(f"balance={balance!r}: expected 'auto' or {k} positive layer counts (one per stage) "
                             f"adding up to the model's {n} layers, e.g. {balancing.even_counts(n, k)}")

    # -- building this rank's stages ----------------------------------------------------------------
    def _build(self, sample: torch.Tensor) -> None:
        assert self._layers is not None
        counts = self._choose_balance(sample)
        bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
        names = {i: [name for name, _ in self._layers[bounds[i]:bounds[i + 1]]] for i in self.stages}
        layers = dict(self._layers)
        body = StageBody(OrderedDict((name, layers[name]) for i in self.stages for name in names[i]))
        for i in self.stages:
            if not any(p.requires_grad for name in names[i] for p in layers[name].parameters()):
                raise ValueError(f"balance {counts} leaves stage {i} ({names[i]}) without trainable parameters: "
                                 "give every stage a layer with parameters, or use balance='auto'")
        versions = (STALE,) if self.schedule_name == "2bw" else ()
        self.model, self.optimizer = prepare(body, self.optimizer_factory(body.parameters()),
                                             self.configs[self.stage], group=self.layout.data_group, versions=versions)
        self.parts = {i: Part(self.model, names[i], self.checkpoint) for i in self.stages}
        if self.schedule_name == "2bw":
            self.versions = WeightVersions(self.model, self.optimizer)
            for part in self.parts.values():
                part.saved = (self.versions.pack, self.versions.unpack)
        self.balance, self._layers = counts, None  # the other stages' layers are no longer ours to keep
        if self._pending_load is not None:
            self.load_checkpoint(self._pending_load)

    def _choose_balance(self, sample: torch.Tensor) -> list[int]:
        if self._pending_load is not None and self.balance_spec == "auto":  # resume with the saved split
            return list(json.loads((self._pending_load / "pipeline.json").read_text())["balance"])
        if not isinstance(self.balance_spec, str):
            return list(self.balance_spec)
        assert self._layers is not None
        choice: list[Any] = [None]
        if dist.get_rank() == 0:  # one rank measures and decides; all follow its choice
            costs = balancing.profile([layer for _, layer in self._layers], sample, self.device,
                                      self.configs[0].torch_dtype)
            flights = in_flight(self.effective_schedule, self.layout.n_ranks, self.n_microbatches, self.virtual)
            dtype, chunk_size = self.configs[0].torch_dtype, self.configs[0].chunk_size
            needs = [balancing.StageNeeds(flights[i], self.checkpoint, (chunk_size or 0) * dtype.itemsize)
                     for i in range(self.n_stages)]
            budgets = [int(c.device_memory) // self.virtual if c.device_memory else None
                       for c in (self.configs[r] for r in self.stage_ranks)]
            input_bytes = sample.nbytes if sample.is_floating_point() else 0
            choice[0] = balancing.partition(costs, self.n_stages, input_bytes, budgets, needs)
        dist.broadcast_object_list(choice, src=0, device=self.comm_device)
        return choice[0]

    def _runner(self, micro: Microbatches, first: torch.Tensor) -> Any:
        """torch's schedule over this rank's stages, or 2BW's Flow, for micro-batches of `micro.rows` rows
        (built once per shape)."""
        key = (micro.rows, tuple(first.shape[1:]), first.dtype)
        if key not in self._runners:
            if self._flow is not None:  # in-flight micro-batches of the old shape finish first
                self._carried = self._flow.flush()
                self._flow = None
            shapes = _scheduled().exchange_shapes(self.parts, first, self.stage_ranks, self.layout, self.comm_device)
            if self.schedule_name == "2bw":
                assert self.versions is not None
                if self._loss_group is None:
                    self._loss_group = dist.new_group([self.layout.global_rank(p) for p in range(self.n_stages)])
                self._runners[key] = Flow(self.parts[self.stage], self.stage, self.layout, shapes[self.stage],
                                          self.comm_device, self.versions, self.n_microbatches, self._loss_group,
                                          self.last_order)
            else:
                self._runners[key] = _scheduled().build(self.effective_schedule, self.parts, shapes, self.n_stages,
                                                        self.n_microbatches, self._loss, self.layout.pipe_group,
                                                        self.last_order)
        return self._runners[key]

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._micro_loss is not None
        return self._micro_loss(output, target)

    # -- training ------------------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor, targets: torch.Tensor, update: bool = True) -> float:
        """One optimizer step on the mini-batch (`inputs`, `targets`), the same tensors on every rank.

        Returns the mini-batch loss on every rank (under data parallelism, the global batch's); under 2BW
        the loss of the mini-batch before (NaN on the first: flow.py's Note), and `flush()` gives the last.
        update=False leaves the gradients in place (they accumulate, as `loss.backward()` does) and
        the stepping to the caller: `pipe.optimizer.step(); pipe.optimizer.zero_grad()` (not under 2BW,
        whose updates are part of the schedule).
        """
        if not update and self.schedule_name == "2bw":
            raise ValueError("step(update=False) under schedule='2bw': 2BW's updates are part of its order (each "
                             "mini-batch's update comes mid-step of the next); use update=True")
        layout = self.layout
        rows = torch.tensor_split(torch.arange(inputs.size(0)), layout.n_replicas)[layout.replica]
        local_in, local_target = inputs[rows], targets[rows]
        micro = Microbatches(local_in.size(0), self.n_microbatches)
        padded_in = micro.pad(local_in)
        if self.model is None:
            self._build(padded_in[:micro.rows])
        elif self._pending_load is not None:  # the load the first step made failed: again, not forgotten
            self.load_checkpoint(self._pending_load)
        assert self.model is not None and self.optimizer is not None
        runner = self._runner(micro, padded_in[:micro.rows])
        d, total = layout.n_replicas, inputs.size(0)
        weight = (lambda n: d * n / total) if self.reduction == "mean" else (lambda n: float(d))
        losses: list[torch.Tensor] = []
        self._micro_loss = micro.loss(self.loss_fn, weight, losses)
        self.last_order.clear()
        has_first, has_last = 0 in self.stages, self.n_stages - 1 in self.stages
        target = micro.pad(local_target) if has_last else None
        if isinstance(runner, Flow):
            if runner is not self._flow:  # another shape ran since: drain it, and count from its updates
                if self._flow is not None:
                    self._carried = self._flow.flush()
                runner.restart()
                self._flow = runner
            split = lambda t: list(t.split(micro.rows)) if t is not None else None  # noqa: E731
            loss = runner.step(Feed(split(padded_in if has_first else None), split(target), self._micro_loss, losses))
            loss, self._carried = (self._carried if math.isnan(loss) else loss), math.nan
            return loss
        for part in self.parts.values():
            part.start_step(self.n_microbatches)
        runner.step(*((padded_in,) if has_first else ()), target=target, return_outputs=False)
        if update:
            self.optimizer.step()
            self.optimizer.zero_grad()
        return self._share_loss(losses)

    def flush(self) -> float:
        """Under 2BW, finish what is in flight (the last mini-batches' backwards and updates) and return the
        last mini-batch's loss; the weights are what they would be without the flush. Else NaN: nothing waits."""
        self.last_order.clear()  # from now on, what the drain runs
        return self._flow.flush() if self._flow is not None else math.nan

    def _share_loss(self, losses: list[torch.Tensor]) -> float:
        """The mini-batch loss, from the last stage to every rank (and summed over pipelines)."""
        layout = self.layout
        value = torch.stack(losses).double().sum().cpu() if losses else torch.zeros((), dtype=torch.float64)
        value = value.to(self.comm_device)
        dist.broadcast(value, src=layout.global_rank(self.stage_ranks[-1]), group=layout.pipe_group)
        if layout.n_replicas > 1:
            dist.all_reduce(value, group=layout.data_group)
        return value.item() / layout.n_replicas

    def gradients(self) -> dict[str, torch.Tensor]:
        """This rank's stages' gradients by parameter name, fp32 on CPU (under ZeRO, its share only)."""
        model, _ = self._built()
        runtime = model.runtime
        return {r.name: r.view(runtime.data.read(r.group.grad)).detach().to("cpu", torch.float32, copy=True)
                for r in runtime.store.records.values() if r.grad_state is TensorState.HOLD and r.group.owned}

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The whole model's consolidated fp32 state dict on CPU, with the original keys, on every rank.
        Under 2BW the newest weights: `flush()` first to include every mini-batch's update.

        A collective: every rank calls it. Names, shapes and dtypes cross first, then the tensors one at a
        time from the rank that holds them (through the device under NCCL), so no device ever holds more
        than one tensor of it; every rank's host memory holds the whole model at the end.
        """
        self._check_loaded("state_dict()")
        if self.model is None:
            assert self._layers is not None
            return nn.Sequential(OrderedDict(self._layers)).state_dict()
        local = self.model.state_dict()
        first_name: dict[int, str] = {}
        mine = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), first_name.setdefault(id(t), name))
                for name, t in local.items() if isinstance(t, torch.Tensor)]  # tied tensors cross once
        extra = {name: value for name, value in local.items() if not isinstance(value, torch.Tensor)}
        specs: list[Any] = [None] * self.layout.n_ranks
        dist.all_gather_object(specs, (mine, extra), group=self.layout.pipe_group)  # modules' extra state as it is
        out: dict[str, Any] = {}
        for position, (spec, objects) in enumerate(specs):
            out.update(objects)
            for name, shape, dtype, tied_to in spec:
                if tied_to != name:
                    out[name] = out[tied_to]
                    continue
                ours = position == self.stage
                tensor = (local[name] if ours else torch.empty(shape, dtype=getattr(torch, dtype))).to(self.comm_device)
                dist.broadcast(tensor, src=self.layout.global_rank(position), group=self.layout.pipe_group)
                out[name] = local[name] if ours else tensor.cpu()
        return {key: out[key] for key in self._keys}

    def save_checkpoint(self, path: str | Path) -> Path:
        """Each rank writes `stage-<position>` (chunkmem's checkpoint format) and rank 0 adds pipeline.json, into a
        directory beside `path` that takes its place once every stage's part is whole: a crash or a stage that
        cannot write leaves the last checkpoint, and every rank raises. Under 2BW the pipeline drains first
        (`flush`), and the older weights version is saved too."""
        self._check_loaded("save_checkpoint()")
        model, optimizer = self._built()
        flushed = self.flush()
        if not math.isnan(flushed):  # the last mini-batch's loss: the next step returns it (flow.py's Note)
            self._carried = flushed
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        failed = attempt(lambda: check_replaceable(path)) if dist.get_rank() == 0 else None
        if failed is None and dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what a save that failed left
        if not all_written(dist.group.WORLD, failed is None):  # every rank raises
            raise failed or CheckpointError(f"rank 0 cannot save the pipeline checkpoint to {path} (its error says "
                                            "why): the previous checkpoint there is intact")
        failed = attempt(lambda: save_checkpoint(tmp / f"stage-{self.stage}", model, optimizer))  # a collective under ZeRO
        written = all_written(dist.group.WORLD, failed is None)
        if written and dist.get_rank() == 0:
            failed = attempt(lambda: self._swap_in(tmp, path))
        written = all_written(dist.group.WORLD, failed is None) and written
        if failed is not None:
            raise failed
        if not written:
            raise CheckpointError(f"another rank could not write its part of the pipeline checkpoint {path} (its "
                                  f"error says why): the previous checkpoint there is intact")
        return path

    def _swap_in(self, tmp: Path, path: Path) -> None:
        """pipeline.json beside the stages' parts, then the whole in place of the last checkpoint."""
        meta = tmp / "pipeline.json"
        meta.write_text(json.dumps({
            "balance": self.balance, "n_stages": self.n_stages, "schedule": self.schedule_name,
            "updates": self.versions.newest if self.versions is not None else None}))
        fsync_file(meta)
        fsync_dir(tmp)
        swap_in(tmp, path)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any] | None:
        """Restore what `save_checkpoint` wrote; the stage split must be the same. Called before the
        first step, the restore happens when the first step builds the stage (balance='auto' then
        takes the saved split), and None is returned."""
        try:  # every rank finds it, or none goes on (a rank without the file system rank 0 wrote to)
            path = existing(Path(path), "pipeline.json")
        except Exception as error:
            all_read(dist.group.WORLD, path, error)
            raise
        all_read(dist.group.WORLD, path, path.name)  # (or the checkpoint a save moved aside: on every rank)
        if self.model is None:
            self._pending_load = path
            return None
        model, optimizer = self._built()
        try:
            meta = json.loads((path / "pipeline.json").read_text())
            if meta["balance"] != self.balance:
                raise ValueError(f"checkpoint {path} was saved with balance {meta['balance']}, this pipeline has "
                                 f"{self.balance}: pass balance={meta['balance']} to chunkmem.pipeline")
            if (meta.get("updates") is None) != (self.versions is None):
                raise ValueError(f"checkpoint {path} was saved with schedule={meta.get('schedule')!r}, this pipeline "
                                 f"runs {self.schedule_name!r}: 2BW's older weights version is in one and not the "
                                 f"other; resume with schedule={meta.get('schedule')!r}")
        except Exception as error:  # the stage's data-parallel ranks, and the other stages, wait in load_checkpoint
            if model.runtime.shards is not None:
                all_read(model.runtime.shards.group, path, error)
            all_read(dist.group.WORLD, path, error)
            raise
        # A stage whose part fails to load (damaged) makes every stage's fail: the stages would hold two steps' values
        result = load_checkpoint(path / f"stage-{self.stage}", model, optimizer, together=dist.group.WORLD)
        if self.versions is not None:
            self.versions.newest = int(meta["updates"])
        self._pending_load = None  # not before: a load the first step made that failed is made again, not forgotten
        return result

    def _check_loaded(self, call: str) -> None:
        """The stages hold the values of the checkpoint load_checkpoint was given: not while its load waits for the
        first step, nor after that load failed (the next step makes it again), when saving would replace a
        checkpoint with the values from before it."""
        if self._pending_load is None:
            return
        when = "before the first step()" if self.model is None else "after the step that loaded it failed"
        raise RuntimeError(f"{call} after load_checkpoint({str(self._pending_load)!r}) and {when}: the stages do not "
                           "hold its values yet (a step builds the stages and loads it); call it after a step that "
                           "succeeded")

    def _built(self) -> tuple[ChunkedModel, ChunkOptimizer]:
        if self.model is None or self.optimizer is None:
            raise RuntimeError("the pipeline's stages are built by the first step(): call step() first "
                               "(or pass an explicit balance and call step on a first batch)")
        return self.model, self.optimizer


def _check_arguments(schedule: str, checkpoint: str, reduction: str, n_microbatches: int,
                     virtual_stages: int | None) -> None:
    _check_choice("schedule", schedule, SCHEDULES)
    _check_choice("checkpoint", checkpoint, CHECKPOINT_MODES)
    _check_choice("reduction", reduction, ("mean", "sum"))
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"n_microbatches={n_microbatches!r}: expected a positive int")
    if virtual_stages is not None:
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"virtual_stages={virtual_stages!r}: expected a positive int (stages per rank)")
        if schedule not in VIRTUAL and virtual_stages != 1:
            raise ValueError(f"virtual_stages={virtual_stages} with schedule={schedule!r}: only {list(VIRTUAL)} "
                             "run several stages per rank; leave virtual_stages out")


def _check_choice(field: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r}: expected one of {list(allowed)}")


def _rank_configs(config: Config | Sequence[Config] | None, n_ranks: int) -> list[Config]:
    configs: list[Config] = list(config) if isinstance(config, (list, tuple)) else \
        [config if isinstance(config, Config) else Config()] * n_ranks
    if len(configs) != n_ranks:
        raise ValueError(f"config: got {len(configs)} Configs for {n_ranks} stages: pass one Config, or one per "
                         "stage (per rank, with several stages per rank)")
    for c in configs:
        if c.dtype == "fp16":
            raise ValueError("Config.dtype='fp16' is not supported in a pipeline (every stage would scale the "
                             "loss again): use dtype='bf16' or 'fp32'")
    return configs


def _scheduled() -> ModuleType:
    """chunkmem.pipeline.scheduled, imported when a pipeline is built: torch.distributed.pipelining, which it
    subclasses, takes about a second to import (dynamo, sympy), which `import chunkmem` should not pay."""
    from chunkmem.pipeline import scheduled
    return scheduled
