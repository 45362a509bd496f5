"""A replay buffer on the training device, filled in blocks from host arrays."""

import math

import numpy as np
import torch

from leanrl_utils import checks


class ReplayBuffer:
    """Transitions (`fields`: name -> (row shape, dtype)) in device tensors allocated once, staged in
    host arrays and copied in blocks (a torch call costs more than a row's copy; on CUDA, a transfer)."""

    def __init__(self, buffer_size, fields, stage_rows, device):
        row_bytes = sum(math.prod(shape) * dtype.itemsize for shape, dtype in fields.values())
        checks.memory(buffer_size * row_bytes, device, f"--buffer-size {buffer_size}")
        self.storage, self.stage = {}, {}
        for k, (shape, dtype) in fields.items():
            self.storage[k] = torch.empty(buffer_size, *shape, dtype=dtype, device=device)
            self.stage[k] = np.zeros((stage_rows, *shape), dtype=torch.empty(0, dtype=dtype).numpy().dtype)
        self.buffer_size, self.stage_rows, self.device = buffer_size, stage_rows, device
        self.pos = self.size = self.pending = 0

    def add(self, **rows):
        """Stage `rows` (name -> [n, *row shape], or one row without its leading 1)."""
        key, value = next(iter(rows.items()))
        n = value.size // self.stage[key][0].size
        for key, value in rows.items():
            self.stage[key][self.pending : self.pending + n] = value
        self.pending += n
        if self.pending + n > self.stage_rows:
            self.flush()

    def flush(self):
        """Copy the staged steps into the device storage, in at most two slices per field."""
        n, pos = self.pending, self.pos
        if n == 0:
            return
        first = min(n, self.buffer_size - pos)
        for key, staged in self.stage.items():
            dest = self.storage[key]
            dest[pos : pos + first].copy_(torch.from_numpy(staged[:first]))
            if first < n:
                dest[: n - first].copy_(torch.from_numpy(staged[first:n]))
        self.pos, self.size, self.pending = (pos + n) % self.buffer_size, min(self.size + n, self.buffer_size), 0

    def sample(self, batch_size):
        """Indices of a uniform batch, drawn on the device (no host sync; a graphed update's input)."""
        self.flush()
        return torch.randint(self.size, (batch_size,), device=self.device)
