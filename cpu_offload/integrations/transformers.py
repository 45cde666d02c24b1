"""The Hugging Face ``Trainer`` integration: ``OffloadCallback`` installs activation offloading
for a training run, planned for a memory budget if asked, logs what it does, and removes itself
when training ends. Importing this module imports ``transformers`` (a test extra of this package,
not a runtime dependency); nothing else in ``cpu_offload`` does.
"""
from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping
from typing import Any, Optional, Sequence, Union

import torch
from torch import nn
from transformers import TrainerCallback

from ..core.checks import check_int, check_keywords
from ..core.device import check_cuda_available
from ..core.errors import OffloadConfigError
from ..plan.search import check_memory_budget, plan_offloading
from ..tools.apply import APPLY_KEYWORDS, apply_offloading, check_hf_offload, check_plan
from ..tools.layers import as_layer_list, find_block_list

__all__ = ["OffloadCallback"]

logger = logging.getLogger(__name__)

LOGGED_STATS = ("copied_out_bytes", "freed_bytes", "reloaded_bytes", "compute_wait_ms")
# plan_kwargs= may name: plan_offloading's arguments the callback does not set itself
PLAN_KEYWORDS = frozenset(inspect.signature(plan_offloading).parameters) - {
    "step_fn", "layers", "memory_budget", "_measure"}


class OffloadCallback(TrainerCallback):
    """Offload the activations of a Hugging Face model's decoder layers for a ``Trainer`` run:
    ``Trainer(..., callbacks=[OffloadCallback(num_layers=4)])``. No model edits.

    At ``on_train_begin`` it finds the model's decoder layers itself (the one list of repeated
    blocks, as FSDP's auto-wrap policies find them: ``find_block_list``), or takes ``layers=``,
    and installs ``apply_offloading`` on them; at ``on_train_end`` it removes it again, so the
    model leaves ``trainer.train()`` as it came in. Evaluation runs under ``no_grad`` and is not
    offloaded. Gradients, and so the losses of the run, are exactly those without offloading.

    With ``memory_budget``, it plans from the first training batch: when the model's first
    training forward begins, it runs ``plan_offloading`` on that batch (forward + backward, no
    optimizer step), then applies the plan and lets the forward go on. What that costs: the
    profiler runs the batch ``warmup + 2 + 6 * repeats`` times, plus ``max(1, warmup) +
    repeats`` with ``selective`` (25 forward + backward passes with the defaults, 9 with
    ``plan_kwargs={"repeats": 1, "selective": False}``), once, before the first step: about that
    many steps' time. Those passes run the batch without offloading, so it must fit in memory
    without it (else plan ahead on a smaller batch and pass ``plan=``); single-process training
    only (under distributed training plan ahead and pass ``plan=``). The first update is
    still exactly the update without the integration: the parameters' gradients and the random
    number generators' states (dropout) are restored after planning, buffers too.

    Logging: the plan (or the layers offloaded) once, and with ``log_every=N`` every ``N``
    optimizer steps the last step's statistics (``offload/copied_out_bytes``,
    ``offload/freed_bytes``, ``offload/reloaded_bytes`` and, when timed,
    ``offload/compute_wait_ms``: the stall), as entries of the Trainer's ``state.log_history``
    (saved with checkpoints in ``trainer_state.json``) and through the ``logging`` logger
    ``cpu_offload.integrations.transformers``; ``last_stats`` holds the latest.

    Args:
        num_layers: offload the first ``num_layers`` decoder layers (as ``apply_offloading``).
        memory_budget: plan for this budget instead (bytes, or a fraction of the peak without
            offloading: as ``plan_offloading``) from the first training batch.
        plan: apply this ``Plan`` (made ahead with ``plan_offloading``).
        layers: the layers to offload, when the model has several lists of repeated blocks
            (the error then names them), e.g. ``layers=model.model.decoder.layers``.
        log_every: log the statistics every this many optimizer steps (0: never).
        plan_kwargs: passed to ``plan_offloading`` with ``memory_budget`` (``repeats``,
            ``link_gbps``, ``selective``, ...).
        **offload_kwargs: passed to ``apply_offloading`` (and ``device`` and
            ``min_tensor_size_to_offload`` to ``plan_offloading``).

    Attributes:
        handle: the ``OffloadingHandle`` while training runs (``None`` before, removed after).
        plan: the plan applied, if any.
        last_stats: the latest logged statistics (a dict), or ``None``.
        plan_seconds: with ``memory_budget``, how long planning took (also logged as
            ``offload/plan_seconds``).

    Raises:
        OffloadConfigError: at construction (not when training starts): not exactly one of
            ``num_layers``, ``memory_budget``, ``plan``, or one of them of the wrong type or
            range; at ``on_train_begin``, a model with none or several lists of repeated blocks
            (pass ``layers=``), or what ``apply_offloading``/``plan_offloading`` reject.
        TypeError: at construction, a keyword that ``apply_offloading`` (``**offload_kwargs``)
            or ``plan_offloading`` (``plan_kwargs``) does not take; the closest name is given.
        RuntimeError: at construction, no ``device=`` (nor a plan's) on a machine without CUDA.

    Example::

        >>> import tempfile, torch, cpu_offload
        >>> from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments
        >>> from cpu_offload.integrations.transformers import OffloadCallback
        >>> model = LlamaForCausalLM(LlamaConfig(
        ...     vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        ...     num_attention_heads=4, num_key_value_heads=2))
        >>> data = [{"input_ids": torch.arange(32) % 128, "labels": torch.arange(32) % 128}] * 4
        >>> callback = OffloadCallback(   # on a GPU: leave out device=
        ...     num_layers=2, min_tensor_size_to_offload=1024,
        ...     device=cpu_offload.SimulatedDevice(), log_every=1)
        >>> args = TrainingArguments(tempfile.mkdtemp(), max_steps=2, use_cpu=True,
        ...     report_to=[], save_strategy="no", disable_tqdm=True)
        >>> trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        >>> _ = trainer.train()   # doctest: +ELLIPSIS
        {'train_runtime': ...}
        >>> callback.handle.removed, callback.last_stats["offload/copied_out_bytes"] > 0
        (True, True)
    """

    def __init__(
        self,
        num_layers: Optional[int] = None,
        *,
        memory_budget: Union[None, int, float] = None,
        plan: Any = None,
        layers: Union[None, nn.ModuleList, nn.Sequential, Sequence[nn.Module]] = None,
        log_every: int = 0,
        plan_kwargs: Optional[dict] = None,
        **offload_kwargs: Any,
    ) -> None:
        given = [k for k, v in (("num_layers", num_layers), ("memory_budget", memory_budget),
                                ("plan", plan)) if v is not None]
        if len(given) != 1:
            raise OffloadConfigError(
                "OffloadCallback needs exactly one of num_layers=k (offload the first k decoder "
                "layers), memory_budget= (plan from the first training batch) or plan= (a "
                f"plan_offloading result), got {', '.join(given) or 'none'}"
            )
        check_int("num_layers", num_layers, minimum=0, allow_none=True,
                  meaning="the number of decoder layers to offload")
        if memory_budget is not None:
            memory_budget = check_memory_budget(memory_budget)
        check_plan(plan)
        if layers is not None:
            as_layer_list(layers)
        check_int("log_every", log_every, minimum=0, meaning="0 (never) or every how many steps")
        if plan_kwargs and memory_budget is None:
            raise OffloadConfigError("plan_kwargs is for memory_budget=; drop it")
        # what train() would pass on, checked now rather than when training starts
        check_keywords("OffloadCallback", offload_kwargs, APPLY_KEYWORDS, "apply_offloading")
        check_keywords("OffloadCallback", plan_kwargs or {}, PLAN_KEYWORDS, "plan_offloading")
        if offload_kwargs.get("device") is None and getattr(plan, "device", None) is None:
            check_cuda_available()
        self.num_layers = None if num_layers is None else int(num_layers)
        self.memory_budget = memory_budget
        self.plan = plan
        self.layers = layers
        self.log_every = log_every
        self.plan_kwargs = dict(plan_kwargs or {})
        self.offload_kwargs = offload_kwargs
        self.handle: Any = None
        self.last_stats: Optional[dict] = None
        self.plan_seconds: Optional[float] = None
        self._state: Any = None
        self._hook: Any = None
        self._planning = False
        self._layers: list = []

    # -- Trainer events ---------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        if model is None:
            raise OffloadConfigError("OffloadCallback needs the Trainer to pass the model")
        self._state = state
        self._layers = as_layer_list(
            self.layers if self.layers is not None else find_block_list(model)
        )
        if self.memory_budget is None:
            self._apply()
        else:  # plan when the first training forward begins, with its batch
            if getattr(args, "world_size", 1) > 1:
                raise OffloadConfigError(
                    "memory_budget= plans inside the first forward, which under distributed "
                    "training would run backward passes the other processes do not; plan ahead "
                    "with cpu_offload.plan_offloading on one process and pass plan="
                )
            check_hf_offload(self._layers, range(len(self._layers)))  # before 25 steps, not after
            self._hook = model.register_forward_pre_hook(
                self._plan_first_batch, with_kwargs=True, prepend=True
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.log_every and self.handle is not None and state.global_step % self.log_every == 0:
            stats = self.handle.stats()
            if stats is None:
                return
            d = stats.to_dict()
            entry = {f"offload/{k}": d[k] for k in LOGGED_STATS if d.get(k) is not None}
            self.last_stats = entry
            self._log(entry)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.handle is not None:
            self.handle.remove()

    # -- internals --------------------------------------------------------------------------------
    def _apply(self) -> None:
        self.handle = apply_offloading(
            self._layers, num_layers=self.num_layers, plan=self.plan, **self.offload_kwargs
        )
        what = self.plan.describe() if self.plan is not None else repr(self.handle)
        entry = {"offload/plan": what, "offload/num_layers": self.handle.num_layers,
                 "offload/recompute": list(self.handle.recompute)}
        if self.plan_seconds is not None:
            entry["offload/plan_seconds"] = round(self.plan_seconds, 3)
        self._log(entry)

    def _log(self, entry: dict) -> None:
        state = self._state
        step = state.global_step if state is not None else 0
        if state is not None:
            state.log_history.append({**entry, "step": step})
        logger.info("cpu_offload at step %d: %s", step, entry)

    def _plan_first_batch(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._planning or not (model.training and torch.is_grad_enabled()):
            return None
        self._hook.remove()
        self._hook = None

        def step() -> None:
            out = model(*args, **kwargs)
            scalar_loss(out).backward()

        plan_kwargs = dict(self.plan_kwargs)
        for key in ("device", "min_tensor_size_to_offload"):
            if key in self.offload_kwargs:
                plan_kwargs.setdefault(key, self.offload_kwargs[key])
        self._planning = True
        try:  # planning restores the gradients, buffers and random state itself
            start = time.perf_counter()
            self.plan = plan_offloading(step, self._layers, self.memory_budget, **plan_kwargs)
            self.plan_seconds = time.perf_counter() - start
        finally:
            self._planning = False
        self._apply()
        return None


def scalar_loss(out: Any) -> torch.Tensor:
    """What the planning steps backpropagate: the model's ``loss`` if it computed one (the batch
    has labels), else the sum of its first output tensor (the same saved activations)."""
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor):
        return out.float().sum()
    values = out.values() if isinstance(out, Mapping) else out
    for v in values:
        if isinstance(v, torch.Tensor) and v.requires_grad:
            return v.float().sum()
    raise OffloadConfigError(
        "memory_budget plans from the first training batch, but the model's output holds no "
        "tensor to backpropagate; plan ahead with plan_offloading and pass plan="
    )
