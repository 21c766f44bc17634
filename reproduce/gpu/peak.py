"""train.py's main with the flags given, then torch.cuda's peak memory over the run and in each phase (the
update, policy_update, and the rest: generation, scoring, the hand-over to the sampler, checkpoints): the GPU
check's timed train.py stages (check.sh). Run from the checkout whose train.py it times (the repository root, or
an older commit's tree in .gpu/old):
    python3 reproduce/gpu/peak.py --backend hf --n 32 --m 16 --steps 3 --out-dir /tmp/pods
"""

import os
import sys
import time

import torch

GiB = 2**30


class PhasePeaks:
    """The peak allocated and reserved memory in the update and outside it, apart. torch.cuda keeps one peak, so
    it is read and reset at each boundary of the update; the whole run's peak is the larger of the two."""

    def __init__(self, cuda: bool = True):
        self.update, self.rest = [0, 0], [0, 0]  # [allocated, reserved] bytes
        self.cuda = cuda  # False: a dry run on a CPU (check.sh tried without a GPU), every figure 0
        self.updated = False  # whether wrap's update ran: else the whole run's peak alone (trl_gpu.py's TRL run)

    def close(self, phase: list) -> None:
        """The phase that ends now: its peak so far, then torch.cuda's peak reset for the next."""
        if not self.cuda:
            return
        phase[:] = max(phase[0], torch.cuda.max_memory_allocated()), max(phase[1], torch.cuda.max_memory_reserved())
        torch.cuda.reset_peak_memory_stats()

    def wrap(self, update):
        def measured_update(*args, **kwargs):
            self.close(self.rest)
            self.updated = True
            try:
                return update(*args, **kwargs)
            finally:
                self.close(self.update)
        return measured_update

    def line(self) -> str:
        """What summary.py reads from each stage's log: the whole run's peak, and where an update was measured, its split."""
        self.close(self.rest)
        whole = [max(a, b) / GiB for a, b in zip(self.update, self.rest)]
        split = f"; in the update {self.update[0] / GiB:.2f} GiB allocated, outside it {self.rest[0] / GiB:.2f}" if self.updated else ""
        return f"CUDA peak allocated {whole[0]:.2f} GiB, reserved {whole[1]:.2f} GiB{split}"


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    import train

    peaks = PhasePeaks(cuda=torch.cuda.is_available())
    if hasattr(train, "policy_update"):  # an older tree's train.py may update under another name: the whole run's peak only
        train.policy_update = peaks.wrap(train.policy_update)
    start = time.time()
    code = train.main(sys.argv[1:])
    print(f"train.main exit {code} after {time.time() - start:.0f} s; {peaks.line()}")
    sys.exit(code)
