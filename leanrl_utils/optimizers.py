"""torch's Adam and RAdam steps as calls on tensors, which a compiled update traces into its one
graph (`optimizer.step()` would break it)."""

import torch
from torch.optim.adam import adam
from torch.optim.radam import radam


class Adam:
    """torch's functional `adam` (what `optim.Adam.step()` runs) on state kept here. `params`: (name,
    parameter) pairs, updated in place; `lr` may be a 0-d tensor annealed in place; `fused`: one
    kernel, for eager updates; `capturable` (CUDA): step counts on the device, no sync."""

    def __init__(self, params, lr, eps=1e-8, fused=False, capturable=False):
        self.params = {name: p.detach() for name, p in params}
        self.exp_avgs = [torch.zeros_like(p) for p in self.params.values()]
        self.exp_avg_sqs = [torch.zeros_like(p) for p in self.params.values()]
        self.steps = [torch.zeros((), device=p.device) for p in self.params.values()]
        self.lr, self.eps, self.fused, self.capturable = lr, eps, fused, capturable

    def state_dict(self):
        return {"exp_avgs": self.exp_avgs, "exp_avg_sqs": self.exp_avg_sqs, "steps": self.steps}

    def load_state_dict(self, state):
        for key, tensors in state.items():
            for mine, saved in zip(getattr(self, key), tensors):
                mine.copy_(saved)

    @torch.no_grad()
    def step(self, grads):
        # torch.func may return a gradient in the layout its backward made (transposed for a
        # weight used as `w.mT`); the fused kernel reads it as if laid out like the weight.
        grads = [grads[name].contiguous() for name in self.params]
        adam(
            list(self.params.values()), grads, self.exp_avgs, self.exp_avg_sqs, [], self.steps,
            foreach=False, fused=self.fused or None, capturable=self.capturable,
            amsgrad=False, beta1=0.9, beta2=0.999, lr=self.lr, weight_decay=0.0, eps=self.eps, maximize=False,
        )  # fmt: skip


class RAdam(Adam):
    """torch.optim.RAdam's step in the shape of `Adam`; `capturable` (a `torch.where` for the branch
    on the step count) is needed under torch.compile and on CUDA, and refused eagerly on a CPU."""

    @torch.no_grad()
    def step(self, grads):
        grads = [grads[name].contiguous() for name in self.params]
        radam(
            list(self.params.values()), grads, self.exp_avgs, self.exp_avg_sqs, self.steps,
            foreach=False, capturable=self.capturable, beta1=0.9, beta2=0.999, lr=self.lr, weight_decay=0.0, eps=self.eps,
        )  # fmt: skip
