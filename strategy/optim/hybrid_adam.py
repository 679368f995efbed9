"""HybridAdam: one Adam(W) over parameters on the CPU and on the accelerator, on DeepSpeed's
kernels.

CPU parameters step through DeepSpeed's SIMD CPU Adam op (fp32 moments whatever the parameter
dtype); accelerator parameters are bucketed by (device, dtype, step) into one multi-tensor fused
Adam call per bucket. ``nvme_offload_fraction`` keeps that share of the CPU moments in files
between steps (see ``strategy.optim.nvme_offload``).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Iterable

import torch

from strategy.errors import fail
from strategy.internals import cpu_adam_op, multi_tensor_adam, new_cpu_adam_id
from strategy.optim.nvme_offload import STATE_KEYS, StateFiles, plan_offload

_CHUNK = 2048 * 32  # elements per multi-tensor chunk, as in DeepSpeed's FusedAdam


def _check_args(lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
                fraction: float) -> None:
    if lr < 0:
        fail("lr", lr, "use a learning rate >= 0")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        fail("betas", betas, "use two values in [0, 1), e.g. (0.9, 0.999)")
    if eps < 0:
        fail("eps", eps, "use a small epsilon >= 0, e.g. 1e-8")
    if weight_decay < 0:
        fail("weight_decay", weight_decay, "use a weight decay >= 0")
    if not 0 <= fraction <= 1:
        fail("nvme_offload_fraction", fraction,
             "use a fraction of the CPU optimizer state in [0, 1]")


class HybridAdam(torch.optim.Optimizer):
    """Adam(W) that steps each parameter where it lives; a drop-in for ``torch.optim.AdamW``
    (``adamw_mode=True``) or ``torch.optim.Adam`` with L2 added to the gradient
    (``adamw_mode=False``).

    Args:
        params: parameters or parameter groups, as for any torch optimizer.
        lr: learning rate.
        bias_correction: correct the moments for their zero start.
        betas: decay rates of the first and second moments.
        eps: added to the denominator.
        weight_decay: decoupled (``adamw_mode``) or L2 weight decay.
        adamw_mode: AdamW's decoupled weight decay; False adds it to the gradient.
        nvme_offload_fraction: share of the CPU moments kept in files between steps.
        nvme_offload_dir: directory of those files; None takes a temporary one.

    Raises:
        ConfigError: a hyperparameter or the offload fraction is out of range.
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adamw_mode: bool = True,
                 nvme_offload_fraction: float = 0.0, nvme_offload_dir: str | None = None) -> None:
        _check_args(lr, tuple(betas), eps, weight_decay, nvme_offload_fraction)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction)
        super().__init__(params, defaults)
        self.adamw_mode = adamw_mode
        self.nvme_offload_fraction = nvme_offload_fraction
        self._cpu_op = self._opt_id = self._fused_op = None
        self._cpu_fresh = False
        self._noop_flags: dict[torch.device, torch.Tensor] = {}
        self.state_files = StateFiles(nvme_offload_dir) if nvme_offload_fraction > 0 else None
        self._planned = False

    def _plan_offload(self) -> None:
        """Choose the parameters whose moments live in files, once, at the first step or load. Lazy
        because ZeRO-Offload swaps the groups' parameters for its fp32 CPU partitions after
        construction."""
        if self.state_files is None or self._planned:
            return
        cpu_params = [p for g in self.param_groups for p in g["params"] if self._is_cpu(p)]
        for param in plan_offload(cpu_params, self.nvme_offload_fraction):
            self.state_files.add(param)
        self._planned = True

    # ------------------------------------------------------------ kernels
    def _is_cpu(self, param: torch.Tensor) -> bool:
        return param.device.type == "cpu"

    def _state_dtype(self, param: torch.Tensor) -> torch.dtype:
        """fp32 moments on the CPU; the parameter's dtype on the accelerator (one dtype per fused
        call)."""
        return torch.float32 if self._is_cpu(param) else param.dtype

    def _cpu_kernel(self):
        if self._cpu_op is None:
            self._cpu_op, self._opt_id = cpu_adam_op(), new_cpu_adam_id()
        if not self._cpu_fresh:
            # The C++ optimizer caches beta^t as a running product; restarted once per step it takes
            # beta^t = pow(beta, t) from the step alone, so a resumed run continues bit for bit.
            defaults = self.defaults
            self._cpu_op.create_adam(self._opt_id, defaults["lr"], defaults["betas"][0],
                                     defaults["betas"][1], defaults["eps"],
                                     defaults["weight_decay"], self.adamw_mode, False)
            self._cpu_fresh = True
        return self._cpu_op

    def _fused_kernel(self) -> Callable:
        if self._fused_op is None:
            self._fused_op = multi_tensor_adam(_CHUNK)
        return self._fused_op

    def __del__(self) -> None:
        if getattr(self, "_cpu_op", None) is not None:
            self._cpu_op.destroy_adam(self._opt_id)
        if getattr(self, "state_files", None) is not None:
            self.state_files.close()

    # ------------------------------------------------------------ stepping
    def _init_state(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = 0
            for key in STATE_KEYS:
                state[key] = torch.zeros(param.shape, dtype=self._state_dtype(param),
                                         device=param.device)
        return state

    @torch.no_grad()
    def step(self, closure: Callable | None = None) -> Any:
        """One Adam step for every parameter with a gradient, where the parameter lives.

        Args:
            closure: re-evaluates the model and returns the loss; optional.

        Returns:
            The closure's loss, or None without one.

        Raises:
            RuntimeError: a gradient is sparse.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._plan_offload()
        self._cpu_fresh = False
        on_cpu = []
        for group in self.param_groups:
            on_accelerator = []
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("HybridAdam does not support sparse gradients; "
                                       "use torch.optim.SparseAdam")
                (on_cpu if self._is_cpu(param) else on_accelerator).append((param, group))
            if on_accelerator:
                self._fused_step([p for p, _ in on_accelerator], group)
        self._cpu_steps(on_cpu)
        return loss

    def _cpu_steps(self, work: list[tuple[torch.Tensor, dict]]) -> None:
        """Update CPU parameters in order; moments kept in files are read one parameter ahead and
        written back behind, on the I/O thread, so file traffic overlaps the SIMD updates."""
        files = self.state_files
        on_file = iter([p for p, _ in work if files is not None and p in files and self.state[p]])
        reads = {}

        def read_next() -> None:
            param = next(on_file, None)
            if param is not None:
                reads[param] = files.read_async(param, torch.float32)

        read_next()
        for param, group in work:
            if param in reads:
                read_next()
                self.state[param].update(reads.pop(param).result())
            self._cpu_step(param, group)
        if files is not None:
            files.drain()

    def _cpu_step(self, param: torch.Tensor, group: dict) -> None:
        state = self._init_state(param)
        state["step"] += 1
        # the op reads the gradient in the parameter's dtype (bf16/fp16 grads of fp32 params upcast
        # exactly)
        grad = param.grad.to(param.dtype).contiguous()
        data = param.data if param.data.is_contiguous() else param.data.contiguous()
        beta1, beta2 = group["betas"]
        self._cpu_kernel().adam_update(self._opt_id, state["step"], group["lr"], beta1, beta2,
                                       group["eps"], group["weight_decay"],
                                       group["bias_correction"], data, grad, state["exp_avg"],
                                       state["exp_avg_sq"])
        if data is not param.data:
            param.data.copy_(data)
        if self.state_files is not None and param in self.state_files:
            self.state_files.write_async(param, state)

    def _fused_step(self, params: list[torch.Tensor], group: dict) -> None:
        buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for param in params:
            state = self._init_state(param)
            state["step"] += 1
            buckets[(param.device, param.dtype, state["step"])].append(param)
        beta1, beta2 = group["betas"]
        for (device, dtype, step), bucket in buckets.items():
            lists = [[p.grad.to(dtype) for p in bucket], [p.data for p in bucket],
                     [self.state[p]["exp_avg"] for p in bucket],
                     [self.state[p]["exp_avg_sq"] for p in bucket]]
            if device not in self._noop_flags:
                self._noop_flags[device] = torch.zeros(1, dtype=torch.int, device=device)
            self._fused_kernel()(self._noop_flags[device], lists, group["lr"], beta1, beta2,
                                 group["eps"], step, int(self.adamw_mode),
                                 int(group["bias_correction"]), group["weight_decay"])

    # ------------------------------------------------------------ checkpoints
    def _indexed_params(self) -> list[tuple[int, torch.Tensor]]:
        """(index, param) in the order torch numbers parameters in a state dict."""
        return list(enumerate(p for g in self.param_groups for p in g["params"]))

    def state_dict(self) -> dict:
        """torch's state dict; moments kept in files are read back into it (the live state stays on
        file).

        Returns:
            ``{"state": ..., "param_groups": ...}`` with fp32 moments of every parameter.
        """
        out = super().state_dict()
        self._plan_offload()
        if self.state_files is not None:
            for index, param in self._indexed_params():
                if param in self.state_files and index in out["state"]:
                    # torch shares the live dict: copy before filling
                    out["state"][index] = dict(out["state"][index])
                    self.state_files.read(param, out["state"][index], torch.float32)
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict, keeping our moment dtypes (fp32 on CPU; torch's loader would cast
        them to the parameter dtype) and writing offloaded moments to their files.

        Args:
            state_dict: as returned by ``state_dict``, from any HybridAdam over the same groups.
        """
        super().load_state_dict(state_dict)
        self._plan_offload()
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for saved_id, (_, param) in zip(ids, self._indexed_params(), strict=True):
            if saved_id not in saved:
                continue
            state = self.state[param]
            state["step"] = int(saved[saved_id]["step"])
            for key in STATE_KEYS:
                state[key] = saved[saved_id][key].to(device=param.device,
                                                     dtype=self._state_dtype(param), copy=True)
            if self.state_files is not None and param in self.state_files:
                self.state_files.write(param, state)
