"""`chunkmem.pipeline`: an nn.Sequential trained as K chunk-managed stages, one per rank.

Each rank builds the whole (CPU or meta-free) model, keeps its stage's layers, and prepares them
with chunkmem under its own Config (its own device budget); torch.distributed.pipelining's
PipelineStage and schedules (GPipe, 1F1B) move activations and gradients between ranks. With
data_parallel=D, world = D x K ranks form D pipelines; stage s of every pipeline shards its model
data over their data-parallel group (chunkmem's ZeRO), which also averages their gradients.

[Note: what stays exact]
Every micro-batch's loss is weighted so that the sum of micro-batch gradients (and the average
across pipelines ZeRO takes) equals the gradient of the loss on the whole mini-batch: a mean-reduced
loss weighs micro-batch i by D * n_i / B, a sum-reduced one by D. torch's own `scale_grads`
(divide by M) is off: it is only right when all micro-batches have the same size, and chunkmem's
gradients live in chunks, not in `p.grad`, where it would look for them.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from chunkmem.checkpoint import load_checkpoint, save_checkpoint
from chunkmem.chunks.state import TensorState
from chunkmem.config import Config
from chunkmem.memory.device import use_device
from chunkmem.pipeline import balance as balancing
from chunkmem.pipeline.schedule import Action, Kind
from chunkmem.pipeline.stage import CHECKPOINT_MODES, Microbatches, StageBody, layers_of, recv_shape, send_shape
from chunkmem.runtime.optim import ChunkOptimizer
from chunkmem.wrapper import LOCAL, ChunkedModel, prepare
from chunkmem.zero.collectives import default_group

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where this rank sits: stage `stage` of pipeline `replica`, and the groups it talks in."""

    stage: int
    n_stages: int
    replica: int
    n_replicas: int
    pipe_group: Any  # the K ranks of this pipeline
    data_group: Any  # the D ranks that run this stage (chunkmem.LOCAL when D = 1)

    def global_rank(self, stage: int) -> int:
        return dist.get_global_rank(self.pipe_group, stage)


def make_layout(data_parallel: int, device: str) -> Layout:
    if default_group(None, device) is None:
        raise RuntimeError("chunkmem.pipeline needs one process per stage: launch with torchrun "
                           "(torchrun --nproc-per-node K script.py) or initialise a process group first")
    world, rank = dist.get_world_size(), dist.get_rank()
    if data_parallel < 1 or world % data_parallel:
        raise ValueError(f"data_parallel={data_parallel} does not divide the world of {world} ranks: "
                         f"use a divisor of {world}")
    k = world // data_parallel
    pipes = [dist.new_group(list(range(p * k, (p + 1) * k))) for p in range(data_parallel)] \
        if data_parallel > 1 else [dist.group.WORLD]
    datas = [dist.new_group(list(range(s, world, k))) for s in range(k)] if data_parallel > 1 else []
    return Layout(rank % k, k, rank // k, data_parallel, pipes[rank // k],
                  datas[rank % k] if datas else LOCAL)


class _RecordingStage(PipelineStage):
    """torch's stage that notes the order it actually ran forwards and backwards in (schedule.py)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.executed: list[Action] = []

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.executed.append(Action(self.stage_index, Kind.FORWARD, fwd_chunk_id))
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.executed.append(Action(self.stage_index, Kind.BACKWARD, bwd_chunk_id))
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)


class Pipeline:
    """See `pipeline()`. After the first `step`, `model`/`optimizer` are this rank's prepared stage."""

    def __init__(self, model: nn.Module, optimizer_factory: OptimizerFactory, loss_fn: LossFn, *,
                 n_microbatches: int, schedule: str, balance: str | Sequence[int], checkpoint: str,
                 reduction: str, config: Config | Sequence[Config] | None, data_parallel: int) -> None:
        _check_choice("schedule", schedule, tuple(SCHEDULES))
        _check_choice("checkpoint", checkpoint, CHECKPOINT_MODES)
        _check_choice("reduction", reduction, ("mean", "sum"))
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches={n_microbatches!r}: expected a positive int")
        first = config[0] if isinstance(config, (list, tuple)) and config else config
        self.layout = make_layout(data_parallel, first.device if isinstance(first, Config) else Config().device)
        self.configs = _stage_configs(config, self.layout.n_stages)
        self.device = use_device(self.configs[self.stage].device)
        # What collectives carry tensors on: NCCL only device memory, gloo host memory.
        self.comm_device = self.device if dist.get_backend(self.layout.pipe_group) == "nccl" else torch.device("cpu")
        self._layers: list[tuple[str, nn.Module]] | None = layers_of(model)
        self._check_balance(balance)
        self.optimizer_factory, self.loss_fn = optimizer_factory, loss_fn
        self.n_microbatches, self.schedule_name, self.checkpoint = n_microbatches, schedule, checkpoint
        self.reduction, self.balance_spec = reduction, balance
        self.balance: list[int] | None = None  # layer counts per stage, once built
        self.model: ChunkedModel | None = None
        self.optimizer: ChunkOptimizer | None = None
        self._runners: dict[tuple, tuple[_RecordingStage, Any]] = {}
        self._micro_loss: LossFn | None = None
        self.last_order: list[Action] = []  # what this rank ran in the last step
        self._pending_load: Path | None = None  # a checkpoint to restore once the stage is built

    @property
    def stage(self) -> int:
        return self.layout.stage

    @property
    def n_stages(self) -> int:
        return self.layout.n_stages

    @property
    def effective_schedule(self) -> str:
        """The schedule that runs: torch's 1F1B needs M >= K; with fewer micro-batches than stages,
        GPipe runs instead (it then holds no more activations than 1F1B could save)."""
        if self.schedule_name == "1f1b" and self.n_microbatches < self.n_stages:
            return "gpipe"
        return self.schedule_name

    def _check_balance(self, balance: str | Sequence[int]) -> None:
        n, k = len(self._layers or []), self.layout.n_stages
        if balance == "auto":
            return
        if isinstance(balance, str) or not all(isinstance(c, int) and c >= 1 for c in balance) \
                or len(balance) != k or sum(balance) != n:
            raise ValueError(f"balance={balance!r}: expected 'auto' or {k} positive layer counts (one per stage) "
                             f"adding up to the model's {n} layers, e.g. {balancing.even_counts(n, k)}")

    # -- building this rank's stage -----------------------------------------------------------------
    def _build(self, sample: torch.Tensor) -> None:
        assert self._layers is not None
        counts = self._choose_balance(sample)
        start = sum(counts[:self.stage])
        body = StageBody(OrderedDict(self._layers[start:start + counts[self.stage]]), self.checkpoint)
        if not any(p.requires_grad for p in body.parameters()):
            raise ValueError(f"balance {counts} leaves stage {self.stage} ({list(body._modules)}) without trainable "
                             "parameters: give every stage a layer with parameters, or use balance='auto'")
        self.model, self.optimizer = prepare(body, self.optimizer_factory(body.parameters()),
                                             self.configs[self.stage], group=self.layout.data_group)
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
            config = self.configs[0]
            costs = balancing.profile([layer for _, layer in self._layers], sample,
                                      self.device, config.torch_dtype)
            k, m = self.n_stages, self.n_microbatches
            needs = [balancing.StageNeeds(m if self.effective_schedule == "gpipe" else min(m, k - s), self.checkpoint)
                     for s in range(k)]
            budgets = [int(c.device_memory) if c.device_memory else None for c in self.configs]
            input_bytes = sample.nbytes if sample.is_floating_point() else 0
            choice[0] = balancing.partition(costs, k, input_bytes, budgets, needs)
        dist.broadcast_object_list(choice, src=0, device=self.comm_device)
        return choice[0]

    def _runner(self, micro: Microbatches, first: torch.Tensor) -> tuple[_RecordingStage, Any]:
        """torch's stage and schedule for micro-batches of `micro.rows` rows (built once per shape)."""
        key = (micro.rows, tuple(first.shape[1:]), first.dtype)
        if key not in self._runners:
            stage_in, stage_out = self._exchange_shapes(first)
            model = self.model
            assert model is not None
            stage = _RecordingStage(model, self.stage, self.n_stages, model.runtime.device.torch_device,
                                    input_args=stage_in, output_args=stage_out, group=self.layout.pipe_group)
            schedule = SCHEDULES[self.effective_schedule](stage, self.n_microbatches, loss_fn=self._loss,
                                                     scale_grads=False)
            self._runners[key] = (stage, schedule)
        return self._runners[key]

    def _exchange_shapes(self, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This stage's input and output for one micro-batch: stage s learns its input shape from s-1."""
        layout, model = self.layout, self.model
        assert model is not None
        device = model.runtime.device.torch_device
        comm_device = self.comm_device
        if self.stage == 0:
            stage_in = first
        else:
            stage_in = recv_shape(layout.global_rank(self.stage - 1), layout.pipe_group, comm_device).to(device)
            stage_in.requires_grad_(stage_in.is_floating_point())
        with torch.no_grad():
            out = model(stage_in)
        if self.stage < self.n_stages - 1:
            send_shape(out, layout.global_rank(self.stage + 1), layout.pipe_group, comm_device)
        return stage_in, out.detach().requires_grad_(out.is_floating_point())

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._micro_loss is not None
        return self._micro_loss(output, target)

    # -- training ------------------------------------------------------------------------------------
    def step(self, inputs: torch.Tensor, targets: torch.Tensor, update: bool = True) -> float:
        """One optimizer step on the mini-batch (`inputs`, `targets`), the same tensors on every rank.

        Returns the mini-batch loss on every rank (under data parallelism, the global batch's).
        update=False leaves the gradients in place (they accumulate, as `loss.backward()` does) and
        the stepping to the caller: `pipe.optimizer.step(); pipe.optimizer.zero_grad()`.
        """
        layout = self.layout
        rows = torch.tensor_split(torch.arange(inputs.size(0)), layout.n_replicas)[layout.replica]
        local_in, local_target = inputs[rows], targets[rows]
        micro = Microbatches(local_in.size(0), self.n_microbatches)
        padded_in = micro.pad(local_in)
        if self.model is None:
            self._build(padded_in[:micro.rows])
        assert self.model is not None and self.optimizer is not None
        stage, schedule = self._runner(micro, padded_in[:micro.rows])
        d, total = layout.n_replicas, inputs.size(0)
        weight = (lambda n: d * n / total) if self.reduction == "mean" else (lambda n: float(d))
        losses: list[torch.Tensor] = []
        self._micro_loss = micro.loss(self.loss_fn, weight, losses)
        body = self.model.module
        assert isinstance(body, StageBody)
        body.start_step(self.n_microbatches)
        stage.executed = []
        args = (padded_in,) if self.stage == 0 else ()
        last = self.stage == self.n_stages - 1
        schedule.step(*args, target=micro.pad(local_target) if last else None, return_outputs=False)
        self.last_order = list(stage.executed)
        if update:
            self.optimizer.step()
            self.optimizer.zero_grad()
        return self._share_loss(losses)

    def _share_loss(self, losses: list[torch.Tensor]) -> float:
        """The mini-batch loss, from the last stage to every rank (and summed over pipelines)."""
        layout = self.layout
        value = torch.stack(losses).double().sum().cpu() if losses else torch.zeros((), dtype=torch.float64)
        value = value.to(self.comm_device)
        dist.broadcast(value, src=layout.global_rank(self.n_stages - 1), group=layout.pipe_group)
        if layout.n_replicas > 1:
            dist.all_reduce(value, group=layout.data_group)
        return value.item() / layout.n_replicas

    def gradients(self) -> dict[str, torch.Tensor]:
        """This rank's stage's gradients by parameter name, fp32 on CPU (under ZeRO, its share only)."""
        model, _ = self._built()
        runtime = model.runtime
        return {r.name: r.view(runtime.data.read(r.group.chunks["grad"])).detach().to("cpu", torch.float32, copy=True)
                for r in runtime.store.records.values() if r.grad_state is TensorState.HOLD and r.group.owned}

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's consolidated fp32 state dict on CPU, with the original keys, on every rank.

        A collective: every rank calls it. Names, shapes and dtypes cross first, then the tensors one at a
        time from the stage that holds them (through the device under NCCL), so no device ever holds more
        than one tensor of it; every rank's host memory holds the whole model at the end.
        """
        if self.model is None:
            assert self._layers is not None
            return nn.Sequential(OrderedDict(self._layers)).state_dict()
        local = self.model.state_dict()
        first_name: dict[int, str] = {}
        mine = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."), first_name.setdefault(id(t), name))
                for name, t in local.items()]  # tied tensors cross once
        specs: list[Any] = [None] * self.n_stages
        dist.all_gather_object(specs, mine, group=self.layout.pipe_group)
        out: dict[str, torch.Tensor] = {}
        for stage, spec in enumerate(specs):
            for name, shape, dtype, tied_to in spec:
                if tied_to != name:
                    out[name] = out[tied_to]
                    continue
                ours = stage == self.stage
                tensor = (local[name] if ours else torch.empty(shape, dtype=getattr(torch, dtype))).to(self.comm_device)
                dist.broadcast(tensor, src=self.layout.global_rank(stage), group=self.layout.pipe_group)
                out[name] = local[name] if ours else tensor.cpu()
        return out

    def save_checkpoint(self, path: str | Path) -> Path:
        """Each stage writes `path/stage-<s>` (chunkmem's checkpoint format); rank 0 adds pipeline.json."""
        model, optimizer = self._built()
        path = Path(path)
        save_checkpoint(path / f"stage-{self.stage}", model, optimizer)  # under ZeRO, a collective of the stage
        if dist.get_rank() == 0:
            (path / "pipeline.json").write_text(json.dumps({"balance": self.balance, "n_stages": self.n_stages,
                                                            "schedule": self.schedule_name}))
        dist.barrier()
        return path

    def load_checkpoint(self, path: str | Path) -> dict[str, Any] | None:
        """Restore what `save_checkpoint` wrote; the stage split must be the same. Called before the
        first step, the restore happens when the first step builds the stage (balance='auto' then
        takes the saved split), and None is returned."""
        path = Path(path)
        if not (path / "pipeline.json").exists():
            raise FileNotFoundError(f"no pipeline checkpoint at {path}: expected {path / 'pipeline.json'}")
        if self.model is None:
            self._pending_load = path
            return None
        model, optimizer = self._built()
        self._pending_load = None
        meta = json.loads((path / "pipeline.json").read_text())
        if meta["balance"] != self.balance:
            raise ValueError(f"checkpoint {path} was saved with balance {meta['balance']}, this pipeline has "
                             f"{self.balance}: pass balance={meta['balance']} to chunkmem.pipeline")
        return load_checkpoint(path / f"stage-{self.stage}", model, optimizer)

    def _built(self) -> tuple[ChunkedModel, ChunkOptimizer]:
        if self.model is None or self.optimizer is None:
            raise RuntimeError("the pipeline's stages are built by the first step(): call step() first "
                               "(or pass an explicit balance and call step on a first batch)")
        return self.model, self.optimizer


def _check_choice(field: str, value: Any, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{field}={value!r}: expected one of {list(allowed)}")


def _stage_configs(config: Config | Sequence[Config] | None, n_stages: int) -> list[Config]:
    configs: list[Config] = list(config) if isinstance(config, (list, tuple)) else \
        [config if isinstance(config, Config) else Config()] * n_stages
    if len(configs) != n_stages:
        raise ValueError(f"config: got {len(configs)} Configs for {n_stages} stages: pass one Config, or one per stage")
    for c in configs:
        if c.dtype == "fp16":
            raise ValueError("Config.dtype='fp16' is not supported in a pipeline (every stage would scale the "
                             "loss again): use dtype='bf16' or 'fp32'")
    return configs
