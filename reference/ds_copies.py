"""The bytes a LIVE DeepSpeed engine copies between device and host under ZeRO-Offload.

minizero counts each of its copies in its ledger (`engine.comm_stats()["d2h"]`, `["h2d"]`,
minizero/offload/host.py). DeepSpeed keeps no count, and on its CPU accelerator the device and
the host are one memory, so no copy can be seen crossing anything. What crosses is read
from the source instead: `track_copies(engine)` wraps, on this engine's optimizer, each
method of DeepSpeed 0.19.8 that copies between the two (with `offload_optimizer` /
`offload_param` on "cpu"), and adds up the bytes the method's copy lines move, from the
tensors it is called with. A copy between a device tensor and a host tensor of another
dtype crosses in the device tensor's dtype when it blocks (torch converts on the CPU) and
in the host tensor's when `non_blocking` (converted on the GPU): measured,
docs/results/cuda-copy-dtype.md. The one such copy below, ZeRO-3's after the step, blocks.
Files are `runtime/zero/...`; b = bytes of a low-precision element.

ZeRO-1/2, `cpu_offload` (stage_1_and_2.py):
    async_inplace_copy_grad_to_fp32_buffer_from_gpu(param)   at the accumulation boundary:
        the piece of the parameter's reduced gradient in this rank's partition, made fp32 on
        the device (`src_tensor.to(fp32)`), copied into the host's fp32 .grad: d2h 4 x piece
    async_accumulate_grad_in_cpu_via_gpu(param)   with gradient accumulation (> 1 backward per
        step): after the first micro-step, the whole parameter's gradient accumulated so far
        comes back from its pinned host buffer `accumulated_grads_in_cpu[param_id]` (h2d b x
        numel) to be added on the device; every micro-step the sum goes back (d2h b x numel)
    _restore_cpu_offload_grad_to_gpu(param)   that buffer back to the device: h2d b x numel
    copy_grads_in_partition, fp32 accumulation (`_use_compact_grad_partition_buffer`): at the
        boundary the partition piece goes straight to the fp32 .grad: d2h 4 x piece
    step: after Adam on the host, each param group's updated low-precision partition
        (param_buffer_of_bit16_for_cpu_offload_groups[i]) is copied into the device's
        bit16 partition: h2d b x P/N per group (counted at `_optimizer_step(i)`, which
        step() calls right before that copy)
ZeRO-3 (stage3.py, partition_parameters.py, partitioned_param_coordinator.py):
    partition_grads(params, grad_partitions)   with offload_optimizer the gradient partition
        buffer (grad_partitions_flat_buffer) is on the host: in the first micro-step the
        reduced partition is copied there (d2h b x n) and the buffer brought back to the
        device (`grad_buffer.to(grad_partition.device)`: h2d b x n); later micro-steps bring
        it back (h2d), add, copy the sum out again (d2h): b x n each way per micro-step
    _offload_grad_partition_at_boundary(param, grad_buffer, ...)   at the boundary the
        partition, made fp32 on the device, into the host fp32 .grad: d2h 4 x n
    _reassign_or_swap_out_partitioned_parameters(i)   after Adam, without offload_param, the
        sub-group's fp32 partition into the device's low-precision one, a blocking copy_
        (converted on the host): h2d b x its numel
    the parameter coordinator's all-gather (`__all_gather_params_`), with offload_param:
        each partitioned parameter's host partition to the device before its all-gather
        (`ds_tensor.to(device)`): h2d b x partition numel, per gather

`counts` is {(micro_step, phase): {"d2h": bytes, "h2d": bytes}}: micro_step is the engine's
`micro_steps` when the copy ran (the boundary step's copies go with its last micro-step),
phase "forward", "backward" or "step" (which engine method was running).
tests/agreement/test_offload_traffic.py checks the counts against minizero's ledger and
against these formulas, run by run.
"""
from __future__ import annotations

from typing import Dict, Tuple


class CopyCounter:
    """The d2h/h2d bytes of one DeepSpeed engine, by (micro_step, phase)."""

    def __init__(self, engine):
        self.engine = engine
        self.phase = "outside"
        self.counts: Dict[Tuple[int, str], Dict[str, int]] = {}

    def add(self, direction: str, nbytes: int) -> None:
        key = (int(self.engine.micro_steps), self.phase)
        entry = self.counts.setdefault(key, {"d2h": 0, "h2d": 0})
        entry[direction] += int(nbytes)

    def step_totals(self, step: int, gas: int) -> dict:
        """{"micro": [{"d2h", "h2d"} of each micro-step's forward and backward], "step": {"d2h",
        "h2d"} of the boundary engine.step} for optimizer step `step` (0-based)."""
        micro = []
        for m in range(step * gas, (step + 1) * gas):
            micro.append({d: sum(v[d] for (k, ph), v in self.counts.items() if k == m and ph != "step")
                          for d in ("d2h", "h2d")})
        last = (step + 1) * gas - 1
        return {"micro": micro, "step": {d: sum(v[d] for (k, ph), v in self.counts.items()
                                             if k == last and ph == "step") for d in ("d2h", "h2d")}}


def _wrap(obj, name: str, before):
    """obj.<name>(...) calls before(*args, **kwargs) first (an instance attribute from now on)."""
    inner = getattr(obj, name)

    def counted(*a, **k):
        before(*a, **k)
        return inner(*a, **k)
    setattr(obj, name, counted)


def _phase(counter: CopyCounter, engine, method: str) -> None:
    inner = getattr(engine, method)

    def in_phase(*a, **k):
        outer, counter.phase = counter.phase, method
        try:
            return inner(*a, **k)
        finally:
            counter.phase = outer
    setattr(engine, method, in_phase)


def track_copies(engine) -> CopyCounter:
    """Count this engine's host<->device copies from now on (module docstring)."""
    counter = CopyCounter(engine)
    for method in ("forward", "backward", "step"):
        _phase(counter, engine, method)
    opt = engine.optimizer
    kind = type(opt).__name__
    if kind == "DeepSpeedZeroOptimizer" and getattr(opt, "cpu_offload", False):
        _zero12(counter, opt)
    elif kind == "DeepSpeedZeroOptimizer_Stage3":
        _zero3(counter, opt)
    return counter


def _zero12(counter: CopyCounter, opt) -> None:
    b = opt.bit16_groups_flat[0].element_size()
    piece = lambda param: opt.grad_position[opt.get_param_id(param)][3]   # noqa: E731 (elements in this partition)

    def to_fp32_grad(param, *a, **k):
        counter.add("d2h", 4 * piece(param))

    def accumulate(param, *a, **k):
        if opt.micro_step_id > 0:
            counter.add("h2d", b * param.numel())
        counter.add("d2h", b * param.numel())

    def restore(param, *a, **k):
        counter.add("h2d", b * param.numel())

    def copy_in_partition(param, group_idx=None, *a, **k):
        group_idx = opt._get_param_group_idx(param) if group_idx is None else group_idx
        if opt._use_compact_grad_partition_buffer(group_idx) and opt.is_gradient_accumulation_boundary():
            counter.add("d2h", 4 * piece(param))

    def parameters_back(i, *a, **k):
        import deepspeed.comm as dist
        partition = opt.parallel_partitioned_bit16_groups[i][dist.get_rank(group=opt.real_dp_process_group[i])]
        counter.add("h2d", partition.numel() * partition.element_size())

    _wrap(opt, "async_inplace_copy_grad_to_fp32_buffer_from_gpu", to_fp32_grad)
    _wrap(opt, "async_accumulate_grad_in_cpu_via_gpu", accumulate)
    _wrap(opt, "_restore_cpu_offload_grad_to_gpu", restore)
    _wrap(opt, "copy_grads_in_partition", copy_in_partition)
    _wrap(opt, "_optimizer_step", parameters_back)


def _zero3(counter: CopyCounter, opt) -> None:
    offload_optimizer = bool(getattr(opt, "offload_optimizer", False))
    offload_param = bool(getattr(opt, "offload_param", False))
    if offload_optimizer:
        def partition_grads(params, grad_partitions, *a, **k):
            for param, g in zip(params, grad_partitions):
                if param.partition_numel() * opt._get_param_partition_rank(param) < param.ds_numel:   # real data
                    counter.add("d2h", g.numel() * g.element_size())
                    counter.add("h2d", g.numel() * g.element_size())

        def at_boundary(param, grad_buffer, *a, **k):
            i = opt.grad_position[opt.get_param_id(param)][0]
            if not opt._swappable_optimizer_subgroup(i):
                counter.add("d2h", 4 * grad_buffer.numel())

        def parameters_back(sub_group_id, *a, **k):
            flat = opt.fp16_partitioned_groups_flat[sub_group_id]
            if flat is not None and not offload_param:
                counter.add("h2d", flat.numel() * flat.element_size())

        _wrap(opt, "partition_grads", partition_grads)
        _wrap(opt, "_offload_grad_partition_at_boundary", at_boundary)
        _wrap(opt, "_reassign_or_swap_out_partitioned_parameters", parameters_back)
    if offload_param:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        coordinator = opt.parameter_offload.get_param_coordinator()

        def gather(params, *a, **k):
            for p in params:
                if p.ds_status == ZeroParamStatus.NOT_AVAILABLE and not getattr(p, "ds_persist", False):
                    counter.add("h2d", p.ds_tensor.numel() * p.ds_tensor.element_size())

        _wrap(coordinator, "_PartitionedParameterCoordinator__all_gather_params_", gather)
