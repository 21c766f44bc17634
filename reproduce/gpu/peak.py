"""train.py's main with the flags given, then torch.cuda's peak memory over the run: the GPU check's timed
train.py stages (check.sh). Run from the checkout whose train.py it times (the repository root, or an older
commit's tree in .gpu/old):
    python3 reproduce/gpu/peak.py --backend hf --n 32 --m 16 --steps 3 --out-dir /tmp/pods
"""

import os
import sys
import time

import torch


def peak_line() -> str:
    """What summary.py reads from each stage's log."""
    return (f"CUDA peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
            f"reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    import train

    start = time.time()
    code = train.main(sys.argv[1:])
    print(f"train.main exit {code} after {time.time() - start:.0f} s; {peak_line()}")
    sys.exit(code)
